"""Native engines: HF models + DTensor TP / EP-inside-TP / FSDP2 training, a KV-cache sampler.

For CPU smoke runs and FSDP-scale training. See docs/engines.md. This module stays light (no
torch import) so ``plan`` can read :data:`CAPABILITIES`; the engines load lazily.
"""
from __future__ import annotations

from ..base import Capabilities

CAPABILITIES = Capabilities(
    name="native", roles=frozenset({"train", "rollout"}), pipeline_parallel=False, expert_parallel=True,
    ep_within_tp=True, expert_tensor_parallel=False, separate_ref_layout=False, devices=("cpu", "cuda", "npu"),
    dtypes=("auto", "bf16", "fp16", "fp32"), requires=("transformers",), install="pip install -e .")
TRAIN = "rlrecipes.engines.native.train:NativeTrainEngine"
ROLLOUT = "rlrecipes.engines.native.rollout:NativeRolloutEngine"
