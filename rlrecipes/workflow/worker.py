"""One worker per device: its own controller loop over the algorithm's stage DAG.

Colocated ("integrated") workers: each holds the actor (train layout), the reference model and
the rollout engine (rollout layout) on its device, in one torch.distributed world. Stages pull
their inputs from the TransferDock (sample data goes worker -> warehouse -> worker, never through
the driver) and from the TensorCache (log-probs stay on the worker that computed them and move by
one all-to-all when another rank needs them); trained weights reach the rollout layout through the
Resharder every step. The driver only starts workers and watches progress.

Rank conventions (docs/conventions.md): a layout's DP rank is ``rank // tp``, its TP rank
``rank % tp``. Within a TP group only TP rank 0 reads from / writes to the dock; the batch is
broadcast to its TP peers (they run the same forward).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import device as dev
from ..metrics import COMPUTE_STAGES, StageTimer, dispatch_skew, tps_per_card
from ..recipe import Recipe
from .dag import build_dag

CKPT_LATEST = "latest"


def _seed_of(*parts: Any) -> int:
    h = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:7], "little")


@dataclass
class StepState:
    """What the stages of one step share on one worker."""

    step: int
    target: int
    round: int = 0
    more: bool = False
    kept_rows: list = field(default_factory=list)
    gen_groups: int = 0
    ds_kept: int = 0
    ds_dropped: int = 0
    reward_sum: float = 0.0
    reward_n: int = 0
    errors: int = 0
    first_error: str | None = None
    update: dict = field(default_factory=dict)
    critic: dict = field(default_factory=dict)


class StageFailure(RuntimeError):
    """A stage failed on a worker; the message names the worker (rank) and the stage."""


class Worker:
    """Runs inside a Ray actor (see ``driver.py``); every public method is called by the driver."""

    def __init__(self, rank: int, world: int, recipe_json: dict, run_dir: str, dock, progress) -> None:
        self.rank, self.world = rank, world
        self.recipe = Recipe.model_validate(recipe_json)
        self.run_dir = Path(run_dir)
        self.dock, self.progress = dock, progress
        self.stage = "init"
        self.step = -1

    # ------------------------------------------------------------------ bring-up
    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def open_store(self) -> int:
        """Rank 0 hosts the rendezvous store on a port the OS picks atomically (no bind race)."""
        self._store = dist.TCPStore("0.0.0.0", 0, self.world, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=max(60.0, self.recipe.trainer.dock_timeout_s)))
        return self._store.port

    def pid(self) -> int:
        return os.getpid()

    def setup(self, master_addr: str, master_port: int, resume_from: str | None = None) -> dict:
        try:
            return self._setup(master_addr, master_port, resume_from)
        except Exception as e:
            raise StageFailure(f"worker rank {self.rank} failed in stage 'setup': {type(e).__name__}: {e}") from e

    def _setup(self, master_addr: str, master_port: int, resume_from: str | None) -> dict:
        import warnings

        # torch's DeviceMesh deprecation notice for flattened dims is not actionable for users
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        r = self.recipe
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world))
        dtype_name = dev.resolve(r.resources.device)
        local_rank = self.rank % r.resources.devices_per_node
        os.environ["LOCAL_RANK"] = str(local_rank)
        torch.set_num_threads(max(1, int(r.resources.cpus_per_worker)))
        self.device = dev.torch_device(dtype_name, local_rank)
        dev.set_device(self.device)
        timeout = timedelta(seconds=max(60.0, r.trainer.dock_timeout_s))
        store = getattr(self, "_store", None) or dist.TCPStore(master_addr, master_port, self.world, is_master=False,
                                                               timeout=timeout)
        dist.init_process_group(dev.comm_backend(dtype_name), store=store, rank=self.rank, world_size=self.world,
                                timeout=timeout)
        dev.manual_seed_all(r.trainer.seed)

        from transformers import AutoTokenizer

        from ..algos import make_kl_controller
        from ..data import PromptDataset, PromptSampler, load_prompt_rows, smoke_task_dataset
        from ..rewards import resolve_reward

        # ---- data and reward
        tok_dir = r.model.tokenizer or (str(self.run_dir / "tokenizer") if r.model.smoke is not None else r.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        if r.data.synthetic:
            rows = smoke_task_dataset(r.data.synthetic_size, seed=r.trainer.seed, task=r.data.synthetic,
                                      num_digits=r.data.synthetic_digits)
        else:
            rows = []
            for f in r.data.train_files:
                got, skipped = load_prompt_rows(f, prompt_key=r.data.prompt_key, answer_key=r.data.answer_key,
                                                on_malformed=r.data.on_malformed)
                rows += got
                self.data_skipped = getattr(self, "data_skipped", 0) + skipped
        # the driver made data paths absolute; the chat template is applied when the tokenizer has one
        if not r.data.apply_chat_template:
            self.tokenizer.chat_template = None
        self.dataset = PromptDataset(rows, self.tokenizer, max_prompt_len=r.data.max_prompt_length)
        self.sampler = PromptSampler(len(self.dataset), seed=r.trainer.seed, shuffle=r.data.shuffle)
        self.reward_fn = resolve_reward(r.reward.fn)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id

        # ---- layouts
        a, ro = r.actor.layout, r.rollout.layout
        self.atp, self.aep = a.tp, a.ep
        self.adp = self.world // (a.tp * a.pp)
        self.rtp, self.rep = ro.tp, ro.ep
        self.rdp = self.world // ro.tp
        self.a_dp_rank, self.a_tp_rank = self.rank // self.atp, self.rank % self.atp
        self.r_dp_rank, self.r_tp_rank = self.rank // self.rtp, self.rank % self.rtp

        # ---- engines
        from ..engines.native.rollout import RolloutEngine
        from ..engines.native.train import TrainEngine, ValueEngine

        source = r.model.dims() if r.model.smoke is not None else r.model.path
        seed = r.trainer.seed
        common = dict(device=self.device, seed=seed, dtype=r.model.dtype)
        self.actor = TrainEngine(source, role="actor", layout=(a.tp, a.ep), lr=r.trainer.lr,
                                 weight_decay=r.actor.weight_decay, grad_clip=r.actor.grad_clip, **common)
        alg = r.algorithm
        self.use_ref = r.ref.enabled and (alg.use_kl_loss or alg.use_kl_in_reward)
        self.ref = TrainEngine(source, role="ref", layout=(a.tp, a.ep), **common) if self.use_ref else None
        self.critic = (ValueEngine(source, layout=(a.tp, a.ep), lr=r.critic.lr, grad_clip=r.actor.grad_clip, **common)
                       if alg.name == "ppo" else None)
        self.rollout = RolloutEngine(source, layout=(ro.tp, ro.ep), device=self.device, seed=seed, dtype=r.model.dtype)
        self.dims = self.actor.dims

        # ---- algorithm switches
        from ..algos import mini_batches_per_rollout, resolve_skip_old_log_prob

        self.n_mini = mini_batches_per_rollout(r.trainer.global_batch, r.trainer.mini_batch)
        self.skip_old = resolve_skip_old_log_prob(alg.skip_old_log_prob, alg.ppo_epochs, self.n_mini)
        self.dag = build_dag(alg.name, use_ref=self.use_ref, skip_old=self.skip_old,
                             dynamic_sampling=alg.dynamic_sampling.enabled)
        self.kl_ctl = make_kl_controller(alg.kl_controller, alg.kl_coef, alg.kl_target, alg.kl_horizon)

        # ---- resharder
        from ..core.resharder import Layout, Resharder, plan_reshard
        from ..models.sharding import param_specs

        specs = param_specs(self.dims)
        self.reshard_plan = plan_reshard(Layout(tp=a.tp, pp=1, ep=a.ep, dp=self.adp),
                                         Layout(tp=ro.tp, pp=1, ep=ro.ep, dp=self.rdp), specs,
                                         dtype_bytes=torch.finfo(self.rollout.dtype).bits // 8)
        self.resharder = Resharder(self.reshard_plan, r.resharding.strategy, bucket_mb=r.resharding.bucket_mb)

        # ---- tensor cache
        from ..core.tensor_cache import TensorCache

        self.cache = TensorCache(self.device, rank=self.rank)

        self.tp_group_actor = self.actor.mesh.tp_mesh.get_group() if self.atp > 1 else None
        start_step = 0
        if resume_from:
            start_step = self._load_checkpoint(Path(resume_from))
        self._reshard()  # rollout weights = actor weights before the first rollout
        return {"rank": self.rank, "device": str(self.device), "start_step": start_step,
                "data": {"prompts": len(self.dataset), "dropped_too_long": self.dataset.n_dropped_too_long,
                         "skipped_malformed": getattr(self, "data_skipped", 0)},
                "skip_old_log_prob": self.skip_old, "stages": self.dag.names(),
                "reshard_min_bytes": self.reshard_plan.min_bytes(self.rank)}

    # ------------------------------------------------------------------ helpers
    def _report(self, stage: str) -> None:
        self.stage = stage
        if self.rank == 0 and self.progress is not None:
            self.progress.stage.remote(self.step, stage)

    def _bcast(self, obj: Any, src: int = 0, group=None) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def _tp_share(self, obj: Any) -> Any:
        """Broadcast TP rank 0's object to its actor-TP peers."""
        if self.tp_group_actor is None:
            return obj
        return self._bcast(obj, src=self.a_dp_rank * self.atp, group=self.tp_group_actor)

    def _micro_batch(self, prompts: list[torch.Tensor], responses: list[torch.Tensor]) -> dict:
        """Left-padded prompts + right-padded responses -> an engine micro-batch."""
        P = max(int(p.numel()) for p in prompts)
        R = max(max(int(x.numel()) for x in responses), 1)
        B = len(prompts)
        ids = torch.full((B, P + R), self.pad_id, dtype=torch.long)  # [B, T]
        attn = torch.zeros((B, P + R), dtype=torch.long)  # [B, T]
        rmask = torch.zeros((B, R), dtype=torch.float32)  # [B, R]
        for i, (p, x) in enumerate(zip(prompts, responses)):
            ids[i, P - p.numel():P] = p
            attn[i, P - p.numel():P] = 1
            ids[i, P:P + x.numel()] = x
            attn[i, P:P + x.numel()] = 1
            rmask[i, :x.numel()] = 1
        return {"input_ids": ids, "attention_mask": attn, "response_mask": rmask}

    @staticmethod
    def _pad_rows(rows: list[torch.Tensor], R: int, value: float = 0.0) -> torch.Tensor:
        out = torch.full((len(rows), R), value, dtype=torch.float32)  # [B, R]
        for i, t in enumerate(rows):
            out[i, :t.numel()] = t.float()
        return out

    # ------------------------------------------------------------------ stages
    def _stage_rollout(self, step: int, rnd: int, n_groups: int) -> dict:
        r, n = self.recipe, self.recipe.trainer.n_samples_per_prompt
        rows = self.dock.add_groups(n_groups, n) if self.rank == 0 else None
        rows = self._bcast(rows)
        prompt_idx = self.sampler.next_indices(n_groups)  # identical on every rank
        mine = list(range(self.r_dp_rank, n_groups, self.rdp))
        prompts = [torch.tensor(self.dataset[prompt_idx[g]]["prompt_ids"], dtype=torch.long) for g in mine for _ in range(n)]
        my_rows = [rows[g * n + j] for g in mine for j in range(n)]
        t0 = time.perf_counter()
        self.rollout.wake()
        stats = {"generated": len(prompts)}
        if prompts:
            s = r.rollout.sampling
            out = self.rollout.generate(prompts, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                        top_p=s.top_p, top_k=max(s.top_k, 0), eos_token_id=self.eos_id,
                                        pad_token_id=self.pad_id, seed=_seed_of(r.trainer.seed, step, rnd))
            if self.r_tp_rank == 0:
                self.dock.put({"prompt_ids": prompts, "response_ids": out.responses,
                               "prompt_index": torch.tensor([prompt_idx[g] for g in mine for _ in range(n)]),
                               "rollout_log_probs": out.log_probs}, my_rows, rank=self.rank)
        self.rollout.sleep()
        self.timer.add_compute("rollout", time.perf_counter() - t0)
        return stats

    def _stage_reward(self) -> dict:
        from ..algos import overlong_reward_penalty
        from ..rewards import format_reward, score_batch

        r = self.recipe
        b = self.dock.get("reward", ["response_ids", "prompt_index"], None, dp_rank=self.rank, dp_size=self.world,
                          timeout=r.trainer.dock_timeout_s)
        texts = [self.tokenizer.decode(x.tolist(), skip_special_tokens=True) for x in b["response_ids"]]
        answers = [self.dataset[int(i)]["answer"] for i in b["prompt_index"]]
        scores, n_err, first = score_batch(self.reward_fn, texts, answers)
        scores = torch.tensor(scores, dtype=torch.float32)  # [rows]
        if r.reward.format_weight:
            scores += r.reward.format_weight * torch.tensor([format_reward(t) for t in texts])
        raw = scores.clone()
        ov = r.algorithm.overlong
        if ov.enabled and len(b):
            lens = b.lengths("response_ids")
            scores = scores + overlong_reward_penalty(lens, max_response_len=r.rollout.sampling.max_new_tokens,
                                                      buffer_len=ov.buffer_len, penalty_factor=ov.penalty_factor)
        if len(b):
            self.dock.put({"scores": scores, "acc": raw}, b.rows, rank=self.rank)
        return {"reward_sum": float(raw.sum()), "reward_n": len(b), "reward_errors": n_err, "reward_error": first}

    def _stage_dynamic_sampling(self, kept_rows: list[list[int]]) -> dict:
        """Rank 0 drops groups whose scores are all equal; returns the kept groups so far."""
        from ..algos import dynamic_sampling_filter

        r = self.recipe
        decision = None
        if self.rank == 0:
            b = self.dock.get("dynamic_sampling", ["scores"], None, whole_groups=True, timeout=r.trainer.dock_timeout_s)
            rows = list(b.rows)
            n = r.trainer.n_samples_per_prompt
            groups = [rows[i:i + n] for i in range(0, len(rows), n)]
            gid = torch.arange(len(rows)) // n
            res = dynamic_sampling_filter(b["scores"].float(), gid)
            kept_g = set(int(g) for g in res.kept_group_ids)
            drop = [x for g, rs in enumerate(groups) if g not in kept_g for x in rs]
            if drop:
                self.dock.drop_rows(drop)
            kept_rows = kept_rows + [rs for g, rs in enumerate(groups) if g in kept_g]
            decision = {"kept_rows": kept_rows, "kept": len(kept_g), "dropped": len(groups) - len(kept_g)}
        return self._bcast(decision)

    def _train_rows(self, consumer: str, columns: list[str], cached: list[str] = (), whole_groups: bool = False):
        """TP rank 0 of each actor-DP group takes its balanced share from the dock; cached columns
        come from the TensorCache by one collective exchange; TP peers receive a copy."""
        r = self.recipe
        b = None
        if self.a_tp_rank == 0:
            b = self.dock.get(consumer, list(columns) + list(cached), None, dp_rank=self.a_dp_rank,
                              dp_size=self.adp, whole_groups=whole_groups, timeout=r.trainer.dock_timeout_s)
        data = {"rows": list(b.rows) if b is not None else [],
                **({c: list(b[c]) if isinstance(b[c], list) else b[c] for c in columns} if b is not None else {})}
        if cached:  # collective on every rank: one all-to-all moves the cached rows to their consumer
            data.update(self.cache.exchange_mine(list(cached), data["rows"]))
        return self._tp_share(data)

    def _logprob_stage(self, consumer: str, engine, out_col: str) -> None:
        data = self._train_rows(consumer, ["prompt_ids", "response_ids"])
        rows = data["rows"]
        if not rows and self.adp == 1:
            return
        t0 = time.perf_counter()
        out: list[torch.Tensor] = []
        if rows:
            mb = self._micro_batch(data["prompt_ids"], data["response_ids"])
            logp, _ = engine.log_probs(mb, micro_batch_size=self.recipe.trainer.micro_batch)
            out = [logp[i, : data["response_ids"][i].numel()].detach().cpu() for i in range(len(rows))]
        self.timer.add_compute(consumer, time.perf_counter() - t0)
        if self.a_tp_rank == 0 and rows:
            self.cache.put(out_col, rows, out)
            self.dock.mark_cached([out_col], rows, self.rank)

    def _stage_advantage(self) -> None:
        from ..algos import grpo_advantage

        r = self.recipe
        if r.algorithm.name == "ppo":
            return self._stage_gae()
        n = r.trainer.n_samples_per_prompt
        b = self.dock.get("advantage", ["scores", "response_ids"], None, dp_rank=self.rank, dp_size=self.world,
                          whole_groups=True, timeout=r.trainer.dock_timeout_s)
        if not len(b):
            return
        scores = b["scores"].float()  # [rows]
        gid = torch.arange(len(b)) // n
        one = torch.ones((len(b), 1))
        adv, _ = grpo_advantage(scores, one, gid, norm_by_std=r.algorithm.norm_adv_by_std and
                                r.algorithm.adv_estimator == "grpo")
        self.dock.put({"advantages": adv[:, 0].contiguous()}, b.rows, rank=self.rank)

    def _stage_gae(self) -> None:
        """PPO: token rewards (score on the last token, optional KL-in-reward), critic values, GAE."""
        from ..algos import apply_kl_penalty, gae_advantage, scores_to_token_rewards

        r, alg = self.recipe, self.recipe.algorithm
        cached = ["values"] + (["ref_log_probs"] if self.use_ref else [])
        b = self.dock.get("advantage", ["scores", "response_ids", "rollout_log_probs"] + cached, None,
                          dp_rank=self.rank, dp_size=self.world, timeout=r.trainer.dock_timeout_s)
        got = self.cache.exchange_mine(cached, list(b.rows))
        if not len(b):
            return
        R = max(int(x.numel()) for x in b["response_ids"])
        mask = b.mask("response_ids", max_len=R).float()  # [rows, R]
        rewards = scores_to_token_rewards(b["scores"].float(), mask)  # [rows, R]
        if alg.use_kl_in_reward and self.use_ref:
            rewards, _ = apply_kl_penalty(rewards, self._pad_rows(b["rollout_log_probs"], R),
                                          self._pad_rows(got["ref_log_probs"], R), mask,
                                          self.kl_ctl.value, alg.kl_estimator)
        values = self._pad_rows(got["values"], R)  # [rows, R]
        adv, ret = gae_advantage(rewards, values, mask, gamma=alg.gamma, lam=alg.lam)
        lens = [int(x.numel()) for x in b["response_ids"]]
        self.dock.put({"advantages": [adv[i, :n].contiguous() for i, n in enumerate(lens)],
                       "returns": [ret[i, :n].contiguous() for i, n in enumerate(lens)]}, b.rows, rank=self.rank)

    def _stage_critic_update(self) -> dict:
        from ..algos import value_loss

        r, alg = self.recipe, self.recipe.algorithm
        data = self._train_rows("critic_update", ["prompt_ids", "response_ids", "returns"], ["values"])
        micro, g_tokens, g_seqs, _ = self._micro_batches(data, ["values"], per_token=("returns",))
        if not micro:
            return {}
        agg = dict(global_tokens=g_tokens, global_seqs=g_seqs, norm_len=r.rollout.sampling.max_new_tokens,
                   dp_size=self.adp)

        def loss_fn(values, _entropy, mb):
            mask = mb["response_mask"].to(values.device)
            loss, m = value_loss(values, mb["values"].to(values.device), mb["returns"].to(values.device), mask,
                                 value_clip=alg.value_clip, loss_agg_mode=alg.loss_agg_mode, **agg)
            return loss, {"critic/vf_clipfrac": float(m["vf_clipfrac"])}

        t0 = time.perf_counter()
        out = self.critic.train_step(micro, loss_fn, loss_scale="sum")
        self.timer.add_compute("critic_update", time.perf_counter() - t0)
        return out

    def _micro_batches(self, data: dict, cached: list[str], per_token: tuple[str, ...] = ()):
        """Micro-batches of this rank's rows (same count on every rank) and the global counts:
        ``(micro_batches, response tokens, sequences, prompt tokens)`` over all DP ranks."""
        rows = data["rows"]
        lead = self.a_tp_rank == 0
        mine = torch.tensor([sum(int(x.numel()) for x in data.get("response_ids", [])) if lead else 0,
                             len(rows) if lead else 0,
                             sum(int(p.numel()) for p in data.get("prompt_ids", [])) if lead else 0],
                            dtype=torch.float64)
        dist.all_reduce(mine)
        mb_size = self.recipe.trainer.micro_batch
        n_mb = torch.tensor([math.ceil(len(rows) / mb_size) if rows else 0])
        dist.all_reduce(n_mb, op=dist.ReduceOp.MAX)
        micro = []
        for k in range(int(n_mb)):
            idx = list(range(k * mb_size, min(len(rows), (k + 1) * mb_size)))
            if idx:
                mb = self._micro_batch([data["prompt_ids"][i] for i in idx], [data["response_ids"][i] for i in idx])
                Rm = mb["response_mask"].shape[1]
                if "advantages" in data:
                    advs = [data["advantages"][i] for i in idx]
                    if all(a.numel() == 1 for a in advs):  # outcome advantage: one number per sample
                        mb["advantages"] = torch.stack([a.reshape(()) for a in advs]).float()[:, None].expand(-1, Rm)
                    else:  # token-level (GAE)
                        mb["advantages"] = self._pad_rows(advs, Rm)
                for c in list(cached) + list(per_token):
                    mb[c] = self._pad_rows([data[c][i] for i in idx], Rm)
            else:  # this rank has fewer rows: a zero-weight micro-batch keeps the collectives in step
                mb = self._micro_batch([torch.tensor([self.pad_id])], [torch.tensor([self.eos_id])])
                mb["response_mask"].zero_()
                for c in ["advantages"] + list(cached) + list(per_token):
                    mb[c] = torch.zeros(1, 1)
            micro.append(mb)
        return micro, float(mine[0]), float(mine[1]), float(mine[2])

    def _stage_update(self) -> dict:
        from ..algos import entropy_bonus, kl_loss, ppo_clip_policy_loss

        r, alg = self.recipe, self.recipe.algorithm
        cached = (["ref_log_probs"] if self.use_ref else []) + ([] if self.skip_old else ["old_log_probs"])
        data = self._train_rows("update", ["prompt_ids", "response_ids", "advantages"], cached)
        R = r.rollout.sampling.max_new_tokens
        kl_coef = self.kl_ctl.value if hasattr(self.kl_ctl, "value") else alg.kl_coef

        def make_loss(agg: dict):
            def loss_fn(logp, entropy, mb):
                mask = mb["response_mask"].to(logp.device)  # [b, R]
                adv = mb["advantages"].to(logp.device) * mask  # [b, R]
                old = mb["old_log_probs"].to(logp.device) if "old_log_probs" in mb else logp.detach()
                loss, m = ppo_clip_policy_loss(logp, old, adv, mask, clip_ratio_low=alg.clip_ratio_low,
                                               clip_ratio_high=alg.clip_ratio_high, dual_clip_c=alg.dual_clip_c,
                                               loss_agg_mode=alg.loss_agg_mode, **agg)
                metrics = {"actor/pg_loss": float(loss.detach()), "actor/clipfrac": float(m["clipfrac"]),
                           "actor/ppo_kl": float(m["ppo_kl"])}
                if self.use_ref:
                    kl = kl_loss(logp, mb["ref_log_probs"].to(logp.device), mask, alg.kl_estimator,
                                 alg.loss_agg_mode, **agg)
                    if alg.use_kl_loss:
                        loss = loss + kl_coef * kl
                    metrics["actor/kl"] = float(kl.detach()) / max(self.adp, 1)
                if alg.entropy_coef and entropy is not None:
                    loss = loss - alg.entropy_coef * entropy_bonus(entropy, mask, alg.loss_agg_mode, **agg)
                return loss, metrics
            return loss_fn

        # LR warm-up, then one optimizer step per mini-batch, ppo_epochs passes over the batch
        if r.trainer.warmup_steps:
            self.actor.set_lr(r.trainer.lr * min(1.0, (self.step + 1) / r.trainer.warmup_steps))
        n_local = len(data["rows"])
        chunks = [list(range(n_local))[m::self.n_mini] for m in range(self.n_mini)]
        t0 = time.perf_counter()
        out: dict = {}
        totals = [0.0, 0.0, 0.0]
        for epoch in range(alg.ppo_epochs):
            for idx in chunks:
                micro, g_tokens, g_seqs, g_prompt = self._micro_batches(self._subset(data, idx), cached)
                if epoch == 0:
                    totals = [totals[0] + g_tokens, totals[1] + g_seqs, totals[2] + g_prompt]
                if not micro:
                    continue
                agg = dict(global_tokens=g_tokens, global_seqs=g_seqs, norm_len=R, dp_size=self.adp)
                out = self.actor.train_step(micro, make_loss(agg), loss_scale="sum",
                                            with_entropy=bool(alg.entropy_coef))
                out["_n_micro"] = len(micro)
        self.timer.add_compute("update", time.perf_counter() - t0)
        if not out:
            return {"actor/skipped_step": 1.0, "tokens": 0}
        # closure metrics are per-rank means of per-micro-batch contributions: sum them over DP
        for key in ("actor/kl", "actor/pg_loss"):
            if key in out:
                t = torch.tensor([out[key] * out["_n_micro"] if self.a_tp_rank == 0 else 0.0])
                dist.all_reduce(t)
                out[key] = float(t)
        out.pop("_n_micro", None)
        g_tokens, g_seqs, g_prompt_tokens = totals
        out["tokens"] = g_tokens + g_prompt_tokens
        out["response_tokens"] = g_tokens
        out["samples"] = g_seqs
        if self.use_ref and "actor/kl" in out and hasattr(self.kl_ctl, "update"):
            self.kl_ctl.update(out["actor/kl"], int(g_seqs))
        return out

    @staticmethod
    def _subset(data: dict, idx: list[int]) -> dict:
        out = {}
        for k, v in data.items():
            if isinstance(v, torch.Tensor):
                out[k] = v[torch.tensor(idx, dtype=torch.long)] if idx else v[:0]
            else:
                out[k] = [v[i] for i in idx]
        return out

    def _reshard(self) -> None:
        self.actor.onload()
        for bucket in self.resharder.reshard(self.actor.local_shards()):
            self.rollout.load_shards(bucket)
        if self.recipe.resharding.swap_optimizer or self.recipe.resharding.swap_grads:
            self.actor.offload()  # no-op on CPU; on accelerators frees the device for the KV cache

    # ------------------------------------------------------------------ the controller loop
    def run(self, start_step: int, end_step: int) -> dict:
        last = {}
        for step in range(start_step, end_step):
            self.step = step
            try:
                last = self.train_step(step)
            except Exception as e:
                raise StageFailure(f"worker rank {self.rank} failed in stage {self.stage!r} of step {step}: "
                                   f"{type(e).__name__}: {e}") from e
            k = self.recipe.trainer.checkpoint_interval
            if k and (step + 1) % k == 0:
                self._report("checkpoint")
                self.save_checkpoint(step)
        if self.recipe.trainer.export_hf and end_step > start_step:
            self._report("export")
            self.export_hf(self.run_dir / "actor_hf")
        self._report("done")
        return {"rank": self.rank, "last": last}

    def export_hf(self, folder: Path) -> None:
        """The trained actor as an HF folder (safetensors + config + tokenizer): collective."""
        self.actor.onload()
        self.actor.export_hf(folder)
        if self.rank == 0:
            self.tokenizer.save_pretrained(str(folder))
        dist.barrier()

    # ------------------------------------------------------------------ stage runners (one per DAG node)
    def _run_rollout(self, st: "StepState") -> None:
        self._stage_rollout(st.step, st.round, st.target)
        st.gen_groups += st.target

    def _run_reward(self, st: "StepState") -> None:
        rs = self._stage_reward()
        st.reward_sum += rs["reward_sum"]
        st.reward_n += rs["reward_n"]
        st.errors += rs["reward_errors"]
        st.first_error = st.first_error or rs["reward_error"]
        st.round += 1

    def _run_dynamic_sampling(self, st: "StepState") -> None:
        d = self._stage_dynamic_sampling(st.kept_rows)
        st.kept_rows, st.ds_kept, st.ds_dropped = d["kept_rows"], st.ds_kept + d["kept"], st.ds_dropped + d["dropped"]
        cap = self.recipe.algorithm.dynamic_sampling.max_gen_batches
        st.more = len(st.kept_rows) < st.target and st.round < cap
        if not st.more:
            if self.rank == 0 and len(st.kept_rows) > st.target:  # trim the surplus groups
                self.dock.drop_rows([x for g in st.kept_rows[st.target:] for x in g])
            dist.barrier()  # every rank sees the final batch before the next stage claims rows

    def _run_ref(self, st: "StepState") -> None:
        self._logprob_stage("ref", self.ref, "ref_log_probs")

    def _run_old(self, st: "StepState") -> None:
        self._logprob_stage("old", self.actor, "old_log_probs")

    def _run_values(self, st: "StepState") -> None:
        self._logprob_stage("values", self.critic, "values")

    def _run_advantage(self, st: "StepState") -> None:
        self._stage_advantage()

    def _run_update(self, st: "StepState") -> None:
        st.update = self._stage_update()

    def _run_critic_update(self, st: "StepState") -> None:
        st.critic = self._stage_critic_update()

    def _run_reshard(self, st: "StepState") -> None:
        self._reshard()

    def train_step(self, step: int) -> dict:
        """One step: this worker's controller loop over the DAG (stages of a repeat group run again
        while dynamic sampling asks for more groups)."""
        r = self.recipe
        self.timer = timer = StageTimer()
        t_step = time.time()
        if self.rank == 0:
            self.dock.reset(step)
        self.cache.clear(step)
        dist.barrier()
        self.actor.onload()
        st = StepState(step=step, target=r.trainer.global_batch)
        stages = self.dag.stages
        i = 0
        while i < len(stages):
            group = stages[i].repeat_group
            j = i + 1
            while group and j < len(stages) and stages[j].repeat_group == group:
                j += 1
            while True:
                for stage in stages[i:j]:
                    self._report(stage.name)
                    with timer.stage(stage.name):
                        getattr(self, f"_run_{stage.name}")(st)
                if not (group and st.more):
                    break
            i = j
        upd, crit = st.update, st.critic
        reward_sum, reward_n, errors, first_err = st.reward_sum, st.reward_n, st.errors, st.first_error
        rnd, ds_kept, ds_dropped, gen_groups = st.round, st.ds_kept, st.ds_dropped, st.gen_groups
        ds = r.algorithm.dynamic_sampling
        step_s = time.time() - t_step

        # ---- metrics: one all-gather of small per-rank facts; rank 0 assembles the row
        mem = dev.memory_stats(self.device)
        facts = {"starts": timer.starts, "seconds": timer.seconds, "compute": timer.compute,
                 "peak": mem.peak_bytes, "reward_sum": reward_sum, "reward_n": reward_n, "errors": errors,
                 "first_error": first_err}
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, facts)
        row: dict[str, Any] = {}
        if self.rank == 0:
            cards = self.world / r.resources.dies_per_card
            tokens = int(upd.get("tokens", 0))
            rsum, rn = sum(g["reward_sum"] for g in gathered), sum(g["reward_n"] for g in gathered)
            stages = {k: max(g["seconds"].get(k, 0.0) for g in gathered) for k in timer.seconds}
            compute = sum(max(g["compute"].get(k, 0.0) for g in gathered) for k in COMPUTE_STAGES)
            row = {
                "step": step,
                "perf/tokens": tokens,
                "perf/tps_per_card": tps_per_card(tokens, step_s, cards),
                **{f"timing_s/{k}": round(v, 4) for k, v in stages.items()},
                "timing_s/step": round(step_s, 4),
                "perf/dispatch_skew_s": round(dispatch_skew(g["starts"] for g in gathered), 4),
                "perf/overhead_share": round(max(0.0, 1.0 - compute / step_s), 4) if step_s > 0 else 0.0,
                "reward/mean": rsum / rn if rn else float("nan"),
                "reward/errors": sum(g["errors"] for g in gathered),
                "actor/loss": upd.get("actor/loss"),
                "actor/pg_loss": upd.get("actor/pg_loss"),
                "actor/kl": upd.get("actor/kl", 0.0),
                "actor/clipfrac": upd.get("actor/clipfrac"),
                "actor/grad_norm": upd.get("actor/grad_norm"),
                "actor/skipped_step": upd.get("actor/skipped_step", 0.0),
                "response_length/mean": upd.get("response_tokens", 0) / max(upd.get("samples", 0), 1),
                "samples": int(upd.get("samples", 0)),
                **{k: v for k, v in crit.items() if k.startswith("critic/")},
                "mem/peak_gb": round(max(g["peak"] for g in gathered) / 2 ** 30, 4),
                "reshard/min_bytes": self.reshard_plan.min_bytes(0),
            }
            if ds.enabled:
                row.update({"dapo/gen_rounds": rnd, "dapo/kept_groups": ds_kept, "dapo/dropped_groups": ds_dropped,
                            "dapo/generated_groups": gen_groups})
            first = next((g["first_error"] for g in gathered if g["first_error"]), None)
            if first:
                row["reward/first_error"] = first
            if self.progress is not None:
                self.progress.metrics.remote(row)
        return row

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int) -> None:
        """DCP model + optimizer, data position, RNG and KL state. ``latest`` is written last
        (atomically), so a run killed mid-save still resumes from the previous checkpoint."""
        ckpt = self.run_dir / "checkpoints" / f"step_{step + 1:06d}"
        self.actor.save(ckpt / "actor")
        if self.critic is not None:
            self.critic.save(ckpt / "critic")
        torch.save(dev.rng_state(), ckpt / f"rng_rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            state = {"next_step": step + 1, "sampler": self.sampler.state_dict(),
                     "kl_coef": getattr(self.kl_ctl, "value", None)}
            (ckpt / "trainer_state.json").write_text(json.dumps(state))
            tmp = self.run_dir / "checkpoints" / f".{CKPT_LATEST}.tmp"
            tmp.write_text(ckpt.name)
            os.replace(tmp, self.run_dir / "checkpoints" / CKPT_LATEST)
        dist.barrier()

    def _load_checkpoint(self, ckpt: Path) -> int:
        self.actor.load(ckpt / "actor")
        if self.critic is not None:
            self.critic.load(ckpt / "critic")
        state = json.loads((ckpt / "trainer_state.json").read_text())
        self.sampler.load_state_dict(state["sampler"])
        if state.get("kl_coef") is not None and hasattr(self.kl_ctl, "value"):
            self.kl_ctl.value = state["kl_coef"]
        rng = ckpt / f"rng_rank{self.rank}.pt"
        if rng.is_file():
            dev.set_rng_state(torch.load(rng, weights_only=True))
        return int(state["next_step"])

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
