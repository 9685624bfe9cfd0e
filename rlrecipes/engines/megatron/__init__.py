"""megatron-core train engine (with MindSpeed on Ascend): PP / EP / expert-TP training at scale.

``convert.py``: HF config -> megatron-core ``TransformerConfig`` architecture keywords, HF <-> megatron
names and layouts; ``layout.py`` (pure): every config keyword the engine passes for a layout
(sequence parallelism with TP > 1, optimizer offload, fp16 loss scaling), the right-aligned rows, and
``layout_problems`` for ``plan``; ``shard.py``: each rank's TP / PP / EP / expert-TP slices
(vocabulary padded to a multiple of TP), their HF-named form in the resharder's layout, the gather for
HF export; ``model.py``: ``GPTModel`` with megatron's decoder block spec (local modules; the engine's
RMSNorm and MLA attention); ``train.py``: the engine (pipeline schedule, megatron DDP and the
distributed optimizer, log-probs broadcast from the last stage); ``state.py``: offload / onload and
per-rank checkpoints. Computes on CUDA (NPU through MindSpeed); ``plan`` refuses other devices
before anything is placed. What ran where: docs/megatron.md.
"""
from __future__ import annotations

from ..base import Capabilities

CAPABILITIES = Capabilities(
    name="megatron", roles=frozenset({"train"}), pipeline_parallel=True, expert_parallel=True,
    expert_tensor_parallel=True, ep_groups="across_dp", separate_ref_layout=False, critic=False,
    memory_model="pipeline",
    sequence_parallel="context_parallel",  # layout.sp -> context_parallel_size (TransformerEngine or MindSpeed)
    devices=("cuda", "npu"),
    dtypes=("auto", "bf16", "fp16", "fp32"), requires=("megatron.core",),
    requires_by_device=(("npu", ("mindspeed", "torch_npu")),),
    install="pip install -e '.[megatron]' (CUDA) or '.[ascend]' plus MindSpeed from source (docs/ascend.md)",
    implemented=True, layout_rules="rlrecipes.engines.megatron.layout:plan_rules",
    status="TP (sequence parallel) / PP (any layer split) / EP / expert-TP, resharder shards, offload, per-rank "
           "checkpoints; actor and ref roles (no critic); Qwen2, Qwen3-MoE and DeepSeek-V3 forward and "
           "gradients checked on CPU with TP2 SP / EP2 (megatron's modules over gloo), TP1 PP1 EP1 steps "
           "on CUDA: docs/megatron.md")
TRAIN = "rlrecipes.engines.megatron.train:MegatronTrainEngine"
CRITIC = None
ROLLOUT = None
