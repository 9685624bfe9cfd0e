"""DAPO pieces (Yu et al. 2025): dynamic-sampling group filter and overlong reward shaping.

Clip-higher lives in :func:`rlrecipes.algos.losses.ppo_clip_policy_loss` (``clip_ratio_high``) and
token-level loss in :func:`rlrecipes.algos.losses.aggregate_loss` (``token-mean``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GroupFilterResult:
    """Outcome of :func:`dynamic_sampling_filter`.

    keep: ``[batch]`` bool, rows of the kept groups.
    kept_groups / dropped_groups: number of prompt groups kept / dropped.
    kept_group_ids: ids of the kept groups (in first-seen order).
    """

    keep: torch.Tensor
    kept_groups: int
    dropped_groups: int
    kept_group_ids: list[int]


def dynamic_sampling_filter(metric: torch.Tensor, group_ids: torch.Tensor, *, atol: float = 0.0) -> GroupFilterResult:
    """Drop prompt groups whose metric (e.g. score, accuracy) is the same for every sample.

    Such groups have zero GRPO advantage and give no gradient. A group of a single sample is kept
    (its metric is trivially constant; there is nothing to compare it to, as in the DAPO reference
    implementation).

    Args:
        metric: ``[batch]`` per-sample metric named by ``dynamic_sampling.metric``.
        group_ids: ``[batch]`` prompt-group index of each row.
        atol: spreads ``max - min <= atol`` count as constant.
    """
    if metric.shape != group_ids.shape or metric.dim() != 1:
        raise ValueError(f"metric and group_ids must both be [batch]; got {tuple(metric.shape)}, {tuple(group_ids.shape)}")
    keep = torch.zeros_like(group_ids, dtype=torch.bool)
    kept, dropped, kept_ids = 0, 0, []
    seen: dict[int, None] = {}
    for g in group_ids.tolist():
        seen.setdefault(int(g), None)
    for g in seen:
        rows = group_ids == g
        vals = metric[rows].float()
        if vals.numel() == 1 or (vals.max() - vals.min()).item() > atol:
            keep |= rows
            kept += 1
            kept_ids.append(g)
        else:
            dropped += 1
    return GroupFilterResult(keep=keep, kept_groups=kept, dropped_groups=dropped, kept_group_ids=kept_ids)


@dataclass
class DynamicSampler:
    """Bookkeeping for "keep generating until the batch is full" (``dynamic_sampling.*``).

    The workflow generates a batch of prompt groups, calls :meth:`add` with their metrics, keeps
    the returned rows, and repeats while :attr:`full` is False. After ``max_gen_batches``
    generation rounds without filling the batch, :meth:`add` raises (``max_gen_batches <= 0``
    means no cap). Keeps counters for the step's metrics.
    """

    target_groups: int
    max_gen_batches: int = 10
    gen_batches: int = 0
    kept_groups: int = 0
    dropped_groups: int = 0
    _history: list[GroupFilterResult] = field(default_factory=list, repr=False)

    @property
    def full(self) -> bool:
        return self.kept_groups >= self.target_groups

    def add(self, metric: torch.Tensor, group_ids: torch.Tensor) -> GroupFilterResult:
        if self.max_gen_batches > 0 and self.gen_batches >= self.max_gen_batches:
            raise RuntimeError(
                f"dynamic sampling: {self.gen_batches} generation batches gave only {self.kept_groups} of "
                f"{self.target_groups} prompt groups with a non-constant metric; raise "
                "algorithm.dynamic_sampling.max_gen_batches, or lower the difficulty spread of the data"
            )
        self.gen_batches += 1
        res = dynamic_sampling_filter(metric, group_ids)
        self.kept_groups += res.kept_groups
        self.dropped_groups += res.dropped_groups
        self._history.append(res)
        return res

    def metrics(self) -> dict[str, float]:
        return {
            "dynamic_sampling/gen_batches": float(self.gen_batches),
            "dynamic_sampling/kept_groups": float(self.kept_groups),
            "dynamic_sampling/dropped_groups": float(self.dropped_groups),
        }


def overlong_reward_penalty(
    response_lengths: torch.Tensor, *, max_response_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the score.

    With ``L_max = max_response_len`` and ``L_cache = buffer_len``::

        0                                          if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache * f    if L_max - L_cache < |y| <= L_max
        -f                                         if |y| > L_max

    Args:
        response_lengths: ``[batch]`` response token counts.
    Returns:
        ``[batch]`` float penalty (<= 0).
    """
    if buffer_len <= 0 or buffer_len > max_response_len:
        raise ValueError(
            f"algorithm.overlong.buffer_len must be in [1, max_response_len={max_response_len}]; got {buffer_len}"
        )
    expected = max_response_len - buffer_len
    exceed = response_lengths.float() - expected
    pen = (-exceed / buffer_len * penalty_factor).clamp(min=-penalty_factor, max=0.0)
    return pen
