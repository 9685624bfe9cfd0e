"""Native engines: HF models + DTensor TP / EP-inside-TP / FSDP2 training, a KV-cache sampler.

For CPU smoke runs and FSDP-scale training. See docs/engines.md. This module stays light (no
torch import) so ``plan`` can read :data:`CAPABILITIES`; the engines load lazily.
"""
from __future__ import annotations

from ..base import Capabilities

SMALL_MODEL_BYTES = 256 << 20
"""A model whose parameters take at most this many bytes (at the master dtype) is *small*: at DP > 1
it is replicated (one all-reduce of all gradients per step) instead of FSDP-sharded when it trains
in full precision, and under FSDP each unit stays gathered for a whole forward / train call. Its
collectives, not its memory, are what cost: the qwen25_7b smoke at DP2 spent a fifth of its step in
FSDP all-gathers and reduce-scatters. ``plan`` applies the same rule (``Capabilities.small_model_bytes``)."""

HEAD_CHUNK_TOKENS = 1024
"""Tokens per chunk of the native engines' head (``head.chunked_logprobs``)."""

MOE_GROUPED_MM = True
"""The native engines' default for ``moe_grouped_mm`` (MoE experts as grouped GEMMs, ``experts.py``).
Measured on the CPU (``benchmarks/train_options.py``, docs/engines.md "Train efficiency options"): a
step 1.30x faster than the loop over experts at a small Qwen3-MoE shape, EPExperts alone 2.4x; on a
GPU unmeasured (``gpu_suite.py`` sweeps it)."""

COMPILE_LAYERS = False
"""The native train engine's default for ``compile_layers`` (``torch.compile`` of each decoder layer,
``compiled.py``). Off: on the CPU the compiled step was within 3-5 % of eager (either way) after a
first step of 18-30 s of inductor code generation per mode and shape, which a CPU run never pays
back; on a GPU unmeasured (``gpu_suite.py`` sweeps it)."""

CAPABILITIES = Capabilities(
    name="native", roles=frozenset({"train", "rollout"}), pipeline_parallel=False, expert_parallel=True,
    ep_groups="within_tp", expert_tensor_parallel=False, separate_ref_layout=False, critic=True, routing_replay=True,
    image_prompts=True,  # engines/native/vision.py: HF's VL forward for prefill, the KV cache after
    lora=True,  # PEFT adapters at TP1 / EP1 (FSDP2 or replicated DP); needs the lora extra
    sequence_parallel="ulysses",  # layout.sp: engines/native/ulysses.py
    head_chunk_tokens=HEAD_CHUNK_TOKENS,  # engines/native/head.py (not an untied vocab-parallel head under FSDP)
    memory_model="fsdp", small_model_bytes=SMALL_MODEL_BYTES, devices=("cpu", "cuda", "npu"),
    dtypes=("auto", "bf16", "fp16", "fp32"), requires=("transformers",), install="pip install -e .")


def small_model(param_bytes: float, limit: int = SMALL_MODEL_BYTES) -> bool:
    return param_bytes <= limit


TRAIN = "rlrecipes.engines.native.train:NativeTrainEngine"
CRITIC = "rlrecipes.engines.native.value:NativeValueEngine"
ROLLOUT = "rlrecipes.engines.native.rollout:NativeRolloutEngine"
