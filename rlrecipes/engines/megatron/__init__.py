"""megatron-core train engine (with MindSpeed on Ascend): PP / EP / expert-TP training at scale.

``convert.py``: HF config -> megatron-core ``TransformerConfig``, HF <-> megatron names and layouts;
``shard.py``: each rank's TP / PP / EP / expert-TP slices (vocabulary padded to a multiple of TP),
their HF-named form in the resharder's layout, the gather for HF export; ``model.py``: ``GPTModel``
with the local layer spec; ``train.py``: the engine (pipeline schedule, megatron DDP and the
distributed optimizer, log-probs broadcast from the last stage); ``state.py``: offload / onload and
per-rank checkpoints. Computes on CUDA (NPU through MindSpeed); ``plan`` refuses other devices
before anything is placed. What ran where: docs/megatron.md.
"""
from __future__ import annotations

from ..base import Capabilities

CAPABILITIES = Capabilities(
    name="megatron", roles=frozenset({"train"}), pipeline_parallel=True, expert_parallel=True,
    expert_tensor_parallel=True, separate_ref_layout=False, critic=False, devices=("cuda", "npu"),
    dtypes=("auto", "bf16", "fp16", "fp32"), requires=("megatron.core",),
    requires_by_device=(("npu", ("mindspeed", "torch_npu")),),
    install="pip install -e '.[megatron]' (CUDA) or '.[ascend]' plus MindSpeed from source (docs/ascend.md)",
    implemented=True,
    status="TP / PP (any layer split) / EP / expert-TP, resharder shards, offload, per-rank checkpoints; "
           "actor and ref roles (no critic); multi-rank layouts checked on CPU for shapes and slices only, "
           "TP1 PP1 EP1 computed on CUDA: docs/megatron.md")
TRAIN = "rlrecipes.engines.megatron.train:MegatronTrainEngine"
ROLLOUT = None
