"""Long sequences in ``rlrecipes plan``: the tokens each train rank holds under ``layout.sp``, the
memory that scales with them, and the rollout KV cache at the recipe's longest sample.

``layout.sp`` splits every row of a micro-batch over ``sp`` devices that see the same samples (the
native engine's Ulysses, megatron's ``context_parallel_size``). A rank then holds ``1 / sp`` of
every row: the saved activations, the layer being recomputed and the logits scale with those
tokens. What does not shrink with ``sp``:

* a micro-batch holds at least one whole sample (a packed micro-batch takes a longer sample alone),
  so at 32K tokens per sample the token budget ``trainer.max_tokens_per_micro_batch`` is no cap;
* the native engine's attention mask over whole rows (``[rows, 1, T, T]`` booleans, built once per
  forward: packed samples and leading padding need it), Ulysses or not;
* megatron's local attention (``DotProductAttention``, which cannot run context parallelism) holds
  ``[rows, heads / tp, T, T]`` scores of the layer in flight; with ``sp > 1`` TransformerEngine's or
  MindSpeed's fused attention replaces it (O(T) memory);
* the head's logits: the native engine runs its head from the hidden states a chunk of tokens at a
  time (``engines/native/head.py``), so only one chunk's logits live at once, except for an untied
  vocab-parallel head under FSDP, which writes them whole; megatron upcasts its
  ``[tokens, vocab / tp]`` logits to fp32 and keeps the response slice, counted whole per rank's tokens.

megatron-core splits each row into ``2 * cp`` chunks (rank ``i`` takes chunks ``i`` and
``2cp - 1 - i``, load balance under the causal mask), and under TP's sequence parallelism each CP
rank's part splits over TP: the engine pads rows to that multiple (:func:`padded_row`), so no
recipe length is refused for it and the padding is counted.

The rollout's KV cache (vLLM's paged cache) is sized per rollout rank, an attention-TP group that
schedules its own share of the step's rows (:func:`kv_check`): one sequence of the longest length
must fit (vLLM refuses to start otherwise), and the note says how many of the rank's concurrent
sequences fit at that length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..models import ModelDims
from ..recipe import Recipe
from ..core.parallel import ParallelLayout
from .checks import KV_LONGEST_RULE, Violation, longest_sample, response_key

GiB = 1024 ** 3
KV_BYTES = 2  # the rollout's KV cache in bf16


def length_text(recipe: Recipe) -> str:
    """``"rollout.sampling.max_new_tokens=32768 + data.max_prompt_length=2048 = 34816 tokens"``."""
    return (f"{response_key(recipe)}={recipe.rollout.max_response_len} + data.max_prompt_length="
            f"{recipe.data.max_prompt_length} = {longest_sample(recipe)} tokens")


def packed_tokens(recipe: Recipe) -> int:
    """Tokens in one micro-batch of an engine that packs: the token budget, but at least one whole
    sample (a longer sample gets a micro-batch of its own); ``micro_batch`` padded rows without a budget."""
    longest = longest_sample(recipe)
    budget = recipe.trainer.max_tokens_per_micro_batch
    return max(budget, longest) if budget else recipe.trainer.micro_batch * longest


def padded_row(length: int, sp: int, tp: int) -> int:
    """The row length megatron gets: a multiple of TP under sequence parallelism (TP > 1); under
    context parallelism (``cp = sp > 1``) ``2 * cp`` load-balanced chunks whose per-rank pair divides
    by TP, i.e. a multiple of ``lcm(2 * cp, cp * tp)`` (the megatron engine's ``cp.padded_length``)."""
    m = 2 * sp if sp > 1 else 1
    if tp > 1:
        m = math.lcm(m, sp * tp)
    return -(-int(length) // m) * m


def rank_tokens(tokens: float, sp: int) -> float:
    """Tokens one SP rank holds of a micro-batch of ``tokens`` (rows padded to a multiple of ``sp``)."""
    return math.ceil(tokens / sp) if sp > 1 else float(tokens)


def mask_bytes(tokens: float, row: int, c: int) -> float:
    """The native engine's attention mask over rows that pack several samples: the boolean ``rows x row
    x row`` (``rows = tokens / row``) and the additive bias in the compute dtype (``c`` bytes) that SDPA
    makes of it for the layer in flight (a boolean mask costs SDPA's fused kernels; the bias is what
    the kernel that takes a mask reads)."""
    return float(tokens) * row * (1 + c)


def local_attention_bytes(rows: int, heads: float, row: int, c: int) -> float:
    """megatron's local ``DotProductAttention`` for one layer: ``[rows, heads, T, T]`` scores (compute
    dtype), their fp32 softmax and the probabilities kept for backward."""
    return rows * heads * float(row) * row * (2 * c + 4)


def layer_bytes(dims: ModelDims, tokens: float, c: int, tp: int, hidden_split: bool) -> float:
    """Every activation one decoder layer saves for backward, for ``tokens`` tokens: ~10 hidden-sized
    tensors per token (split over TP under sequence parallelism, else replicated) and ~4 of the MLP
    width (split over TP; MoE: the routed experts' and shared experts' width)."""
    width = dims.intermediate_size if not dims.is_moe else \
        dims.moe_intermediate_size * (dims.experts_per_token + dims.num_shared_experts)
    return tokens * c * (10 * dims.hidden_size / (tp if hidden_split else 1) + 4 * width / tp)


def logits_bytes(dims: ModelDims, tokens: float, tp: int, per_element: float) -> float:
    """The head's ``[tokens, vocab / tp]`` logits at ``per_element`` bytes each (every copy the
    engine holds at its peak: compute-dtype logits, fp32 copies)."""
    return float(tokens) * dims.vocab_size / tp * per_element


# ---------------------------------------------------------------------------------------------
# rollout KV cache
# ---------------------------------------------------------------------------------------------
def kv_token_bytes(dims: ModelDims, tp: int) -> float:
    """KV cache bytes one token takes on one rollout device: GQA heads split over TP (replicated once
    TP exceeds them), MLA's latent replicated on every TP rank."""
    per = dims.kv_bytes_per_token(KV_BYTES)
    return float(per) if dims.is_mla else per / min(tp, max(1, dims.num_kv_heads))


def rollout_ranks(rollout: ParallelLayout) -> int:
    """Rollout ranks that schedule their own rows: one per attention-TP group (an instance, or a
    data-parallel attention rank of an expert-parallel instance)."""
    return max(1, rollout.world // rollout.tp)


@dataclass
class KvCheck:
    """The rollout KV cache at the longest sample, per device."""

    longest: int
    one: float
    """Bytes of one longest sequence's KV cache on a device."""
    rows_per_rank: float
    concurrent: int
    """Sequences a rollout rank runs at once: ``min(max_num_seqs, its rows of the step)``."""
    need: float
    """Bytes ``concurrent`` longest sequences take on a device."""
    left: float
    """Bytes the device has for the KV cache (its budget less the rollout weights)."""

    @property
    def holds(self) -> int:
        """Longest sequences the KV cache holds at once."""
        return int(self.left // self.one) if self.one else 0


def kv_check(dims: ModelDims, rollout: ParallelLayout, recipe: Recipe, rows: int, left: float,
             device_bytes: float) -> tuple[KvCheck, list[Violation], Optional[str]]:
    """The KV cache a rollout device needs at the recipe's longest sample, the violations, and a note
    when it holds fewer longest sequences than a rollout rank runs at once.

    ``rows``: the step's rows (prompts x samples); ``left``: the KV bytes the device's budget leaves.
    Violations: not even one longest sequence fits (vLLM refuses to start), or the cache is below
    the smaller of what the rank's concurrency needs and 5 % of the device."""
    inf = recipe.rollout.inference
    longest = longest_sample(recipe)
    per = kv_token_bytes(dims, rollout.tp)
    ranks = rollout_ranks(rollout)
    per_rank = rows / ranks
    concurrent = int(min(inf.max_num_seqs, max(1, math.ceil(per_rank))))
    k = KvCheck(longest, longest * per, per_rank, concurrent, concurrent * longest * per, left)
    fixes = []
    if not dims.is_mla and rollout.tp < dims.num_kv_heads:
        fixes.append(f"raise rollout.layout.tp (TP{rollout.tp} now; up to TP{dims.num_kv_heads} splits the "
                     f"{dims.num_kv_heads} KV heads)")
    elif dims.is_mla:
        fixes.append(f"raise rollout.layout.tp (TP{rollout.tp} now; it splits the weights, not MLA's latent cache)")
    if dims.is_moe:
        fixes.append(f"raise rollout.layout.ep (EP{rollout.ep} now; fewer expert weights per device)")
    if inf.gpu_memory_utilization < 0.95:
        fixes.append(f"raise rollout.inference.gpu_memory_utilization ({inf.gpu_memory_utilization} now)")
    what = (f"{length_text(recipe)}: one sequence's KV cache takes {k.one / GiB:.2f} GiB per rollout device "
            f"({per / 1024:.0f} KiB per token at rollout TP{rollout.tp})")
    v: list[Violation] = []
    if left < k.one:
        v.append(Violation(KV_LONGEST_RULE, f"{what}, {left / GiB:.2f} GiB is left after the rollout weights; "
                                            + "; ".join(fixes + [f"or lower {response_key(recipe)}"])))
        return k, v, None
    if left < min(k.need, 0.05 * device_bytes):
        v.append(Violation("KV cache fits the device",
                           f"only {left / GiB:.2f} GiB left for the KV cache per rollout device: {concurrent} "
                           f"sequences of {longest} tokens ({response_key(recipe)}="
                           f"{recipe.rollout.max_response_len}) need {k.need / GiB:.2f} GiB; "
                           + "; ".join(fixes + [f"or fewer samples per rollout instance (rollout.inference."
                                                f"max_num_seqs={max(1, k.holds)})"])))
        return k, v, None
    note = None
    if k.holds < concurrent:
        note = (f"rollout KV cache: {left / GiB:.2f} GiB per device holds {k.holds} sequences of {longest} tokens "
                f"({response_key(recipe)}={recipe.rollout.max_response_len}); each of the {ranks} rollout ranks "
                f"(TP{rollout.tp}) runs up to {concurrent} at once ({per_rank:g} rows of the step, max_num_seqs "
                f"{inf.max_num_seqs}), so responses that long queue or are preempted: "
                + "; ".join(fixes[:1] + [f"or fewer samples per instance (rollout.inference.max_num_seqs="
                                         f"{max(1, k.holds)} schedules what fits)"]))
    return k, v, note


def sequence_summary(recipe: Recipe, roles: dict[str, ParallelLayout], memory_model: str) -> dict:
    """What the plan prints about long sequences: the longest sample, each train role's SP and the
    tokens of a row one of its ranks holds (megatron: after padding to its chunk multiple)."""
    longest = longest_sample(recipe)
    out: dict = {"longest_sample": longest, "roles": {}}
    for name, r in roles.items():
        if name == "rollout":
            continue
        row = padded_row(longest, r.sp, r.tp) if memory_model == "pipeline" else \
            -(-longest // r.sp) * r.sp
        out["roles"][name] = {"sp": r.sp, "row_tokens": row, "tokens_per_rank": row // r.sp}
    return out


__all__ = ["GiB", "KvCheck", "kv_check", "kv_token_bytes", "layer_bytes", "length_text", "local_attention_bytes",
           "logits_bytes", "longest_sample", "mask_bytes", "packed_tokens", "padded_row", "rank_tokens",
           "response_key", "rollout_ranks", "sequence_summary"]
