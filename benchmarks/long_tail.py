"""Long-tailed responses: does partial rollout with over-sampling take the tail off the critical path?
One JSON line per mode.

The task is the long-tail smoke task (``data.synthetic=longtail``: "d*n=" asks for the digit d
written n times; 90 % of prompts want 2-4 digits, 10 % want 40-60). A randomly initialised smoke
model has no such tail (nearly every sample runs long), so the benchmark first teaches a smoke model
the task by supervised steps on the reference answers (``--warm-steps``, seconds on this machine)
and saves it as an HF folder; every mode then starts from it (``model.path``). Its responses are
then mostly short with a tenth long -- the shape of reasoning RL.

Modes, all ``rlrecipes run qwen25_7b --smoke`` on 2 devices with the same data, model and batch:

- ``colocated``: 2 workers, each holding actor and rollout in turn (synchronous);
- ``disaggregated_k1``: 1 train worker + 1 rollout worker, ``algorithm.max_staleness=1``;
- ``partial``: the same with ``rollout.partial=true`` (a new version interrupts the generation;
  the unfinished samples continue under it);
- ``partial_oversample``: the same with ``rollout.oversample`` (default 3): a step trains on the
  first complete groups, the unfinished stay in the dock for the next step.

Per mode (medians over steps 3..; the first steps hold warm-up and the pipeline fill):
``step_s``; ``train_busy`` (share of a step the trainer computes: its compute seconds over the
step) and ``rollout_busy`` (the rollout's generation seconds over the step);
``discarded_token_share`` (generated tokens neither trained on nor left in the dock, over all
generated tokens: 0 when nothing is thrown away); the response length; and, for the pooled modes,
the carried groups and their age. The last line compares ``partial_oversample`` with
``disaggregated_k1`` (the target is at most 0.7).

Usage: ``python benchmarks/long_tail.py [--steps 16] [--warm-steps 400] [--oversample 3]``.
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

COMMON = ["data.synthetic=longtail", "rollout.sampling.max_new_tokens=128", "trainer.export_hf=false",
          "resources.cpus_per_worker=1", "trainer.checkpoint_interval=0"]
DISAGG = ["resources.placement=disaggregated", "resources.rollout_devices=1", "algorithm.max_staleness=1"]


def modes(oversample: float) -> dict[str, list[str]]:
    return {"colocated": [], "disaggregated_k1": DISAGG, "partial": DISAGG + ["rollout.partial=true"],
            "partial_oversample": DISAGG + ["rollout.partial=true", f"rollout.oversample={oversample:g}"]}


def warm_start(folder: Path, steps: int, seed: int = 0) -> None:
    """A smoke qwen2 model taught the long-tail task by teacher forcing on the reference answers."""
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


def run(mode: str, extra: list[str], steps: int, model: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "rlrecipes", "run", "qwen25_7b", "--smoke", "--quiet", "--steps", str(steps),
           "--devices-per-node", "2", "--keep-batch", "--out", str(out), f"model.path={model}", *COMMON, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"mode": mode, "error": (p.stderr.strip() or p.stdout.strip()).splitlines()[-5:]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    used = rows[3:]

    def med(key: str) -> float:
        return statistics.median(float(r.get(key) or 0.0) for r in used)

    step_s = med("timing_s/step")
    train = sum(med(k) for k in ("compute_s/update", "compute_s/ref", "compute_s/old"))
    generated = sum(r.get("rollout/generated_tokens", 0) for r in rows)
    out_row = {"mode": mode, "steps_used": len(used), "step_s": round(step_s, 4),
               "train_busy": round(train / step_s, 3), "rollout_busy": round(med("compute_s/rollout") / step_s, 3),
               "response_length_mean": round(med("response_length/mean"), 2),
               "tokens_per_s": round(med("perf/tokens") / step_s, 1),
               "staleness_max": max(r.get("async/staleness_max", 0) for r in rows)}
    if generated:  # a pooled rollout counts what it generated; the rest of the modes train every token
        trained = sum(r.get("response_tokens") or r["response_length/mean"] * r["samples"] for r in rows)
        in_dock = rows[-1].get("rollout/pool_dock_tokens", 0)
        out_row.update(discarded_token_share=round(max(0.0, 1 - (trained + in_dock) / generated), 4),
                       token_staleness_max=max(r.get("async/token_staleness_max", 0) for r in rows),
                       carried_groups_mean=round(med("rollout/pool_carried_groups"), 2),
                       carried_age_max=max(r.get("rollout/pool_carried_age_max", 0) for r in rows),
                       interrupts=sum(r.get("rollout/interrupts", 0) for r in rows))
    else:
        out_row["discarded_token_share"] = 0.0
    return out_row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warm-steps", type=int, default=400)
    ap.add_argument("--oversample", type=float, default=3.0)
    ap.add_argument("--modes", default="colocated,disaggregated_k1,partial,partial_oversample")
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "warm"
        warm_start(model, a.warm_steps)
        table = modes(a.oversample)
        for mode in a.modes.split(","):
            results[mode] = run(mode, table[mode], a.steps, model, Path(tmp) / mode)
            print(json.dumps(results[mode]), flush=True)
    base, best = results.get("disaggregated_k1", {}), results.get("partial_oversample", {})
    if "step_s" in base and "step_s" in best:
        print(json.dumps({"compare": "partial_oversample / disaggregated_k1", "step_s_ratio":
                          round(best["step_s"] / base["step_s"], 3), "target": 0.7}), flush=True)


if __name__ == "__main__":
    main()
