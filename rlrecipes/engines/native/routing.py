"""Rollout routing replay (R3) for MoE models: the rollout records which experts each token was
routed to, and the training forward uses exactly those experts.

Without it the trainer's router, on slightly different numerics (batching, kernels, dtypes), can
pick other experts for the same token than the rollout did, so the importance ratios of MoE RL
are computed against a different sub-network; replay removes that source of mismatch.

Mechanism: a forward hook on every top-k router module (transformers' ``Qwen3MoeTopKRouter``,
``DeepseekV3TopkRouter``: ``forward(h) -> (logits, weights, indices)``), numbered by MoE layer.

* **record** (rollout): each call's ``indices [tokens, k]`` are kept per layer; the sampler
  assembles them per sample as ``[prompt + response tokens, moe_layers, k]``.
* **replay** (training): the hook gets ``[tokens, moe_layers, k]`` aligned with the flattened
  ``input_ids`` of the call; rows with expert id ``-1`` (padding, or the last token, which the
  rollout never fed back) keep the router's own choice. The gate weights are recomputed from the
  trainer's router logits at the replayed experts, so the router still trains.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

UNSET = -1


def routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router modules, in layer order."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def gate_weights(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The router's weights for experts ``idx [tokens, k]``, from its ``logits [tokens, E]``."""
    if hasattr(router, "e_score_correction_bias"):  # DeepSeek-V3: sigmoid scores, scaled
        w = logits.float().sigmoid().gather(1, idx)
        if router.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)  # Qwen3-MoE
    if router.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w.to(logits.dtype)


class RoutingHooks:
    """Record or replay the routing of every MoE layer of ``model`` (one instance per engine)."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        self.mode: Optional[str] = None
        self.records: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.replay: Optional[torch.Tensor] = None  # [tokens, layers, k]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @property
    def layers(self) -> int:
        return len(self.routers)

    def _hook(self, layer: int):
        def hook(mod, _args, out):
            logits, weights, idx = out
            if self.mode == "record":
                self.records[layer].append(idx.detach().to("cpu", torch.int32))
            elif self.mode == "replay" and self.replay is not None:
                want = self.replay[:, layer].to(idx.device, idx.dtype)  # [tokens, k]
                if want.shape != idx.shape:
                    raise RuntimeError(f"routing replay: layer {layer} got {tuple(idx.shape)} routed tokens but the "
                                       f"replay holds {tuple(want.shape)}")
                keep = (want < 0).any(-1, keepdim=True)  # [tokens, 1]: not recorded -> the router's choice
                idx = torch.where(keep, idx, want)
                weights = torch.where(keep, weights, gate_weights(mod, logits, idx).to(weights.dtype))
                out = (logits, weights, idx)
            return out

        return hook

    # ---- record (rollout)
    def start_recording(self) -> None:
        self.mode = "record"
        self.records = [[] for _ in self.routers]

    def stop(self) -> None:
        self.mode, self.replay = None, None

    def recorded(self) -> list[list[torch.Tensor]]:
        """Per MoE layer, per forward call, the ``[tokens, k]`` experts (calls: prefill, then decode steps)."""
        return self.records

    # ---- replay (training)
    def start_replay(self, routed: torch.Tensor) -> None:
        """``routed [batch, seq, layers, k]`` aligned with the next forward's ``input_ids [batch, seq]``."""
        self.mode = "replay"
        self.replay = routed.reshape(-1, routed.shape[-2], routed.shape[-1])


def attach(model: nn.Module) -> RoutingHooks:
    """Hooks on ``model``'s routers; a model without any (dense) is an error."""
    hooks = RoutingHooks(model)
    if not hooks.layers:
        raise ValueError(f"routing replay needs an MoE model; {type(model).__name__} has no top-k router")
    return hooks


def per_sample_routing(records: list[list[torch.Tensor]], prompt_lens: list[int], padded_prompt_len: int,
                       response_lens: list[int]) -> list[torch.Tensor]:
    """Assemble the sampler's records into ``[p_i + r_i, layers, k]`` per sample.

    ``records[layer][0]`` is the prefill over the left-padded prompts: ``[B * P, k]``, over the
    packed prompts (``prefill_layout="packed"``: ``[sum(p_i), k]``, prompt after prompt), or ``[B, k]``
    when the sampler ran that layer on the last prompt position only (the last layer's other
    positions feed nothing); ``records[layer][t]`` for ``t >= 1`` is the decode step that fed
    response token ``t - 1`` (``[B, k]``). Positions no call covered (the last response token,
    which is never fed back) are :data:`UNSET`.
    """
    B, P = len(prompt_lens), padded_prompt_len
    layers, k = len(records), records[0][0].shape[-1]
    prefill = torch.full((B, P, layers, k), UNSET, dtype=torch.int32)  # [B, P, layers, k]
    packed = sum(prompt_lens)  # B * P without padding, B with one-token prompts: the same layouts then
    for layer, calls in enumerate(records):
        first = calls[0]
        if first.shape[0] == B * P:
            prefill[:, :, layer] = first.reshape(B, P, k)
        elif first.shape[0] == packed:
            for i, part in enumerate(first.split(list(prompt_lens))):
                prefill[i, P - part.shape[0]:, layer] = part
        elif first.shape[0] == B:
            prefill[:, P - 1, layer] = first
        else:
            raise RuntimeError(f"routing record: layer {layer}'s prefill routed {first.shape[0]} tokens, "
                               f"expected {B * P}, {packed} or {B}")
    n_steps = min(len(calls) for calls in records) - 1
    steps = (torch.stack([torch.stack(calls[1:1 + n_steps], dim=1) for calls in records], dim=2)
             if n_steps > 0 else torch.empty((B, 0, layers, k), dtype=torch.int32))  # [B, steps, layers, k]
    out = []
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        row = torch.full((p + r, layers, k), UNSET, dtype=torch.int32)
        row[:p] = prefill[i, P - p:]
        n = min(r - 1, n_steps) if r > 0 else 0
        if n > 0:
            row[p:p + n] = steps[i, :n]
        out.append(row)
    return out
