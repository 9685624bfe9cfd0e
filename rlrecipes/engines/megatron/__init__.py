"""megatron-core train engine (with MindSpeed on Ascend): PP / EP / expert-TP training at scale.

Declared here so ``plan`` sizes the recipes that pin it. Written so far: ``convert.py`` (HF config
-> megatron-core ``TransformerConfig``; HF <-> megatron parameter names and layouts, per pipeline
stage) and ``model.py`` (``GPTModel`` from a model's dims, HF weights loaded), checked against the
modules megatron-core builds and, on CUDA, against HF logits (docs/megatron.md). The train engine
itself (pipeline schedule, distributed optimizer, resharder specs, checkpoints) is not written yet
(``CAPABILITIES.implemented`` is False), so ``run`` refuses it before placing anything.
"""
from __future__ import annotations

from ..base import Capabilities

CAPABILITIES = Capabilities(
    name="megatron", roles=frozenset({"train"}), pipeline_parallel=True, expert_parallel=True,
    expert_tensor_parallel=True, separate_ref_layout=True, devices=("cuda", "npu"),
    dtypes=("auto", "bf16", "fp16", "fp32"), requires=("megatron.core",),
    requires_by_device=(("npu", ("mindspeed", "torch_npu")),),
    install="pip install -e '.[megatron]' (CUDA) or '.[ascend]' plus MindSpeed from source (docs/ascend.md)",
    implemented=False,
    status="written for TP1 PP1 EP1 and checked on CUDA; TP/PP/EP slicing, resharder specs and checkpoints "
           "are not: docs/megatron.md")
TRAIN = None
ROLLOUT = None
