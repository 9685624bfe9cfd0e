"""Long-tailed responses: does partial rollout with over-sampling take the tail off the critical path,
and what does the token-staleness bound cost? One JSON line per run, then the comparisons.

The task is the long-tail smoke task (``data.synthetic=longtail``: "d*n=" asks for the digit d
written n times; 90 % of prompts want 2-4 digits, 10 % want 40-60), with a limit of 128 new tokens.
Two models, every mode starting from each (``model.path``):

- ``warmed`` (the regime the pooled rollout is for): a smoke model taught the task by supervised
  steps on the reference answers (``--warm-steps``). Its typical answer is a few tokens, far below
  the limit, with a tenth long -- the shape of reasoning RL;
- ``unwarmed``: the same model before those steps (random weights). Its answers end at a random
  ``<eos>``, so lengths spread over the whole limit and nearly every group of 8 holds a long one.

A profile line per model (sampled outside the runs: response length p50 / p90, the longest
response of each group -- the time a group takes -- and the share of groups that finish within two
chunks) says which regime it is in, and why the ratios differ.

Modes, all ``rlrecipes run qwen25_7b --smoke`` on 2 devices with the same data, model and batch
(``--modes``; the first four are the default):

- ``disaggregated_k1``: 1 train worker + 1 rollout worker, ``algorithm.max_staleness=1``;
- ``pooled``: the same with ``rollout.partial=true rollout.oversample=3``, under the recipe's bound
  (``algorithm.max_token_staleness`` = ``max_staleness`` = 1: no trained token older than one
  version; ``rollout.on_stale=regenerate``);
- ``pooled_finish``: the same bound kept by ``rollout.on_stale=finish`` (a group about to pass it
  is finished in the step instead of regenerated later);
- ``pooled_unbounded``: the bound lifted (``max_token_staleness=1000``), as the pooled rollout ran
  before the bound: the difference is what the bound costs;
- also ``pooled_loose`` (``max_token_staleness`` = ``--loose-bound``), ``colocated`` and
  ``partial`` (partial rollout without over-sampling).

Per run (steps 3.. ; the first steps hold warm-up and the pipeline fill): ``step_s`` (median),
``s_per_sample`` (their seconds over the samples they trained: a pooled step may train more than
its batch, see docs/workflow.md), ``samples_per_step``, the trained response length, and for the
pooled modes the token staleness, the share of generated tokens thrown away by regeneration, the
length bias (``rollout/length_bias``, mean) and the carried groups' age. Then per model and pooled
mode one ``compare`` line: ``step_s_ratio`` and ``s_per_sample_ratio`` against
``disaggregated_k1`` (the target is at most 0.7).

Usage: ``python benchmarks/long_tail.py [--steps 16] [--warm-steps 400] [--models warmed,unwarmed]
[--modes ...] [--cache DIR]`` (``--cache`` keeps the warmed model between invocations).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LIMIT = 128  # rollout.sampling.max_new_tokens
CHUNK = 8    # rollout.chunk_tokens (the default)
COMMON = ["data.synthetic=longtail", f"rollout.sampling.max_new_tokens={LIMIT}", "trainer.export_hf=false",
          "resources.cpus_per_worker=1", "trainer.checkpoint_interval=0"]
TRAIN_STAGES = ("reward", "ref", "old", "advantage", "update")
DISAGG = ["resources.placement=disaggregated", "resources.rollout_devices=1", "algorithm.max_staleness=1"]


def modes(oversample: float, loose: int) -> dict[str, list[str]]:
    pooled = DISAGG + ["rollout.partial=true", f"rollout.oversample={oversample:g}"]
    return {"colocated": [], "disaggregated_k1": DISAGG, "partial": DISAGG + ["rollout.partial=true"],
            "pooled": pooled, "pooled_unbounded": pooled + ["algorithm.max_token_staleness=1000"],
            "pooled_finish": pooled + ["rollout.on_stale=finish"],
            "pooled_loose": pooled + [f"algorithm.max_token_staleness={loose}"]}


def warm_start(folder: Path, steps: int, seed: int = 0) -> None:
    """A smoke qwen2 model taught the long-tail task by teacher forcing on the reference answers
    (``steps=0``: the random initial model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlrecipes.data import build_smoke_tokenizer, smoke_task_dataset
    from rlrecipes.models.catalog import hf_config, smoke_dims

    torch.manual_seed(seed)
    build_smoke_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    rows = smoke_task_dataset(2048, seed=seed, task="longtail")
    model = AutoModelForCausalLM.from_config(hf_config(smoke_dims("qwen2")))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)

    def encode(row: dict) -> tuple[list[int], int]:
        d, n = row["answer"].split("*")
        prompt = [tok.bos_token_id] + tok(row["prompt"], add_special_tokens=False)["input_ids"]
        return prompt + tok(d * int(n), add_special_tokens=False)["input_ids"] + [tok.eos_token_id], len(prompt)

    model.train()
    for _ in range(steps):
        batch = [encode(r) for r in rng.sample(rows, 32)]
        width = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (x, p) in enumerate(batch):
            ids[i, :len(x)] = torch.tensor(x)
            labels[i, p:len(x)] = torch.tensor(x[p:])
            mask[i, :len(x)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))


def sample_task(folder: Path, prompts: int, n: int, limit: int, seed: int = 1234) -> list[list[tuple[int, float]]]:
    """``n`` responses (temperature 1, at most ``limit`` tokens) of the model in ``folder`` to each of
    the first ``prompts`` long-tail prompts of the runs' data (``trainer.seed``'s): per prompt, each
    response's (length with ``<eos>``, smoke reward)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlrecipes.data import smoke_task_dataset
    from rlrecipes.rewards.smoke import smoke_reward

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    rows = smoke_task_dataset(prompts, seed=seed, task="longtail")
    out: list[list[tuple[int, float]]] = [[] for _ in rows]
    by_len: dict[int, list[int]] = {}
    enc = [[tok.bos_token_id] + tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    for i, ids in enumerate(enc):
        by_len.setdefault(len(ids), []).append(i)
    eos = tok.eos_token_id
    with torch.no_grad():
        for _, idx in sorted(by_len.items()):  # prompts of one length together: no padding
            ids = torch.tensor([enc[i] for i in idx]).repeat_interleave(n, 0)  # [rows * n, P]
            done = torch.zeros(ids.shape[0], dtype=torch.bool)
            resp, past, inp = [], None, ids
            for _ in range(limit):
                res = model(input_ids=inp, past_key_values=past, use_cache=True)
                past = res.past_key_values
                t = torch.multinomial(torch.softmax(res.logits[:, -1].float(), -1), 1).squeeze(-1)
                t = torch.where(done, torch.full_like(t, eos), t)
                resp.append(t)
                done |= t == eos
                inp = t[:, None]
                if bool(done.all()):
                    break
            resp = torch.stack(resp, 1)  # [rows * n, L]
            for k, row in enumerate(resp.tolist()):
                length = row.index(eos) + 1 if eos in row else len(row)
                text = tok.decode(row[:length], skip_special_tokens=True)
                i = idx[k // n]
                out[i].append((length, smoke_reward(text, rows[i]["answer"])))
    return out


def profile(folder: Path, name: str, limit: int = LIMIT, chunk: int = CHUNK) -> dict:
    """The model's response lengths on the task, and what they mean for a pooled step."""
    groups = sample_task(folder, 64, 8, limit)
    lens = sorted(x for g in groups for x, _ in g)
    longest = sorted(max(x for x, _ in g) for g in groups)

    def q(xs: list, p: float) -> int:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    early = sum(x <= 2 * chunk for x in longest) / len(longest)
    row = {"profile": name, "response_len_p50": q(lens, 0.5), "response_len_p90": q(lens, 0.9),
           "at_limit_share": round(sum(x >= limit for x in lens) / len(lens), 3),
           "group_longest_p50": q(longest, 0.5), "groups_done_in_2_chunks": round(early, 3), "limit": limit}
    if early >= 0.5:
        row["regime"] = ("long tail: most groups finish within two chunks, far below the limit; a pooled step "
                         "trains on them while the few long groups continue, so the step need not wait for the tail")
    else:
        row["regime"] = ("no short majority: most groups hold a response that runs long (a group is as slow as its "
                         "longest of 8), so no batch's worth of groups completes early; over-sampling generates "
                         "more groups and each step still waits about as long as a synchronous one")
    return row


def run(extra: list[str], steps: int, model: Path, out: Path) -> list[dict] | str:
    """A run's metrics rows, or its error's last lines."""
    cmd = [sys.executable, "-m", "rlrecipes", "run", "qwen25_7b", "--smoke", "--quiet", "--steps", str(steps),
           "--devices-per-node", "2", "--keep-batch", "--out", str(out), f"model.path={model}", *COMMON, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return " | ".join((p.stderr.strip() or p.stdout.strip()).splitlines()[-5:])
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def summarize(mode: str, runs: list[list[dict]], skip: int = 3) -> dict:
    """Figures of one or more runs of a mode from their metrics rows (steps ``skip``.. of each for
    the timings; the runs' steps together)."""
    used = [r for rows in runs for r in rows[skip:]]
    rows = [r for rows in runs for r in rows]

    def med(key: str) -> float:
        return statistics.median(float(r.get(key) or 0.0) for r in used)

    step_s = med("timing_s/step")
    # the train workers' own part of a step: their stages but the weight send (whose time is mostly
    # the wait for the rollout to take the weights); a step is at least this long
    trainer_s = statistics.median(sum(r.get(f"timing_s/{k}", 0.0) for k in TRAIN_STAGES) for r in used)
    samples = sum(r["samples"] for r in used)
    train = sum(med(k) for k in ("compute_s/update", "compute_s/ref", "compute_s/old"))
    generated = sum(r.get("rollout/generated_tokens", 0) for r in rows)
    trained = sum(r["response_length/mean"] * r["samples"] for r in rows)
    out_row = {"mode": mode, "steps_used": len(used), "step_s": round(step_s, 4),
               "s_per_sample": round(sum(r["timing_s/step"] for r in used) / max(samples, 1), 5),
               "samples_per_step": round(samples / max(len(used), 1), 1),
               "trainer_s": round(trainer_s, 4), "train_busy": round(train / step_s, 3),
               "rollout_busy": round(med("compute_s/rollout") / step_s, 3),
               "response_length_mean": round(trained / max(sum(r["samples"] for r in rows), 1), 2),
               "reward_last5": round(statistics.mean(r.get("reward/trained_mean", r.get("reward/mean", 0.0))
                                                     for rr in runs for r in rr[-5:]), 4),
               "staleness_max": max(r.get("async/staleness_max", 0) for r in rows)}
    if generated:  # a pooled rollout counts what it generated; the rest of the modes train every token
        in_dock = sum(rr[-1].get("rollout/pool_dock_tokens", 0) for rr in runs)
        thrown = sum(r.get("rollout/pool_restarted_tokens", 0) for r in rows)
        out_row.update(discarded_token_share=round(max(0.0, 1 - (trained + in_dock) / generated), 4),
                       regenerated_token_share=round(thrown / generated, 4),
                       token_staleness_max=max(r.get("async/token_staleness_max", 0) for r in rows),
                       length_bias_mean=round(statistics.mean(r.get("rollout/length_bias", 0.0) for r in rows), 3),
                       carried_groups_mean=round(med("rollout/pool_carried_groups"), 2),
                       carried_age_max=max(r.get("rollout/pool_carried_age_max", 0) for r in rows),
                       committed_age_max=max(r.get("rollout/pool_committed_age_max", 0) for r in rows),
                       interrupts=sum(r.get("rollout/interrupts", 0) for r in rows),
                       chunks_per_step=round(statistics.mean(r.get("rollout/pool_chunks", 0) for r in used), 2))
    else:
        out_row["discarded_token_share"] = 0.0
    return out_row


def model_folder(root: Path, warm_steps: int) -> Path:
    """The warmed (or, with 0 steps, the random initial) model, made once under ``root``."""
    folder = root / f"longtail_warm{warm_steps}"
    if not (folder / "config.json").exists():
        warm_start(folder, warm_steps)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warm-steps", type=int, default=400)
    ap.add_argument("--oversample", type=float, default=3.0)
    ap.add_argument("--loose-bound", type=int, default=4, help="pooled_loose's algorithm.max_token_staleness")
    ap.add_argument("--models", default="warmed,unwarmed")
    ap.add_argument("--modes", default="disaggregated_k1,pooled,pooled_finish,pooled_unbounded")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per model and mode, interleaved (a shared machine's load moves between runs)")
    ap.add_argument("--cache", default=None, help="keep the models here (made once) instead of a temporary folder")
    a = ap.parse_args()
    table = modes(a.oversample, a.loose_bound)
    names, mode_names = a.models.split(","), a.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.cache) if a.cache else Path(tmp)
        folders = {name: model_folder(root, a.warm_steps if name == "warmed" else 0) for name in names}
        profiles = {name: profile(folders[name], name) for name in names}
        for name in names:
            print(json.dumps({"model": name, **profiles[name]}), flush=True)
        runs: dict[tuple[str, str], list] = {}
        each: dict[tuple[str, str, int], dict] = {}  # one run's figures
        for rep in range(a.repeats):
            for name in names:
                for mode in mode_names:
                    got = run(table[mode], a.steps, folders[name], Path(tmp) / f"{name}_{mode}_{rep}")
                    line = {"model": name, "repeat": rep, **(summarize(mode, [got]) if isinstance(got, list)
                                                             else {"mode": mode, "error": got})}
                    print(json.dumps(line), flush=True)
                    if isinstance(got, list):
                        runs.setdefault((name, mode), []).append(got)
                        each[name, mode, rep] = line
        results: dict[str, dict[str, dict]] = {}
        for (name, mode), got in runs.items():
            results.setdefault(name, {})[mode] = res = summarize(mode, got)
            print(json.dumps({"model": name, "repeats": len(got), **res}), flush=True)
        for name, by_mode in results.items():
            base = by_mode.get("disaggregated_k1", {})
            for mode, res in by_mode.items():
                if mode.startswith("pooled") and "step_s" in res and "step_s" in base:
                    pairs = [(each[name, mode, r], each[name, "disaggregated_k1", r]) for r in range(a.repeats)
                             if (name, mode, r) in each and (name, "disaggregated_k1", r) in each]
                    print(json.dumps({"compare": f"{mode} / disaggregated_k1", "model": name,
                                      "token_staleness_max": res["token_staleness_max"],
                                      "step_s_ratio": round(res["step_s"] / base["step_s"], 3),
                                      "s_per_sample_ratio": round(res["s_per_sample"] / base["s_per_sample"], 3),
                                      # the least the step ratio could be if its rollout took no time
                                      "trainer_floor_ratio": round(res["trainer_s"] / base["step_s"], 3),
                                      # each repeat's pair of runs, one after the other: the spread
                                      # says how much the machine's load moved the ratio
                                      "step_s_ratio_by_repeat": [round(x["step_s"] / k["step_s"], 3) for x, k in pairs],
                                      "target": 0.7}), flush=True)
            p = profiles[name]  # why this model's ratios are what they are
            print(json.dumps({"model": name, "why": p["regime"], "group_longest_p50": p["group_longest_p50"],
                              "groups_done_in_2_chunks": p["groups_done_in_2_chunks"]}), flush=True)


if __name__ == "__main__":
    main()
