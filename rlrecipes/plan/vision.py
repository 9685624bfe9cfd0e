"""What images cost a vision-language recipe (Qwen2.5-VL), for ``rlrecipes plan``.

From the processor's settings (``data.max_pixels``: the largest area an image is resized to) and
the model's vision dims:

* image tokens per image: ``tokens_for(side, side)`` at the capped area (merged 2x2 patches of
  14 pixels: ``max_pixels / 28^2``, 1,280 at the default), the patches the tower runs on (x4);
* the vision tower's activations in a train micro-batch: every block's saved tensors (~10 of the
  tower's width and 4 of its MLP width per patch, in the compute dtype) and one block's working set
  in backward when the tower trains; one block's working set (the forward of a block) when it is
  frozen (``actor.freeze_vision_tower``: a frozen block saves nothing for backward); and the merger's
  saved input either way. The attention runs per window through SDPA's fused kernels, so no
  ``patches^2`` scores (``benchmarks/vision_memory.py``, fp32 on the CPU, Qwen2.5-VL-7B's tower at 2-3 blocks, 448^2 and
  616^2 images: 0.97-1.10 of the measured peak, trained and frozen; benchmarks/results/vision_memory_cpu.jsonl);
* the tower's FLOPs per image (``vision_flops_per_image``), which the step-time model adds to the
  rollout's prefill and to every train pass;
* the KV cache the image tokens occupy: they are prompt tokens (``data.max_prompt_length`` holds
  them), so the rollout's KV check already counts them; the plan reports their share.

The images of a micro-batch: one per sample (geometry3k's rows hold one image each), at most the
samples that fit the micro-batch.
"""
from __future__ import annotations

import math

from .. import device as devmod
from ..models import ModelDims
from ..models.vision import settings_of
from ..recipe import Recipe


def image_tokens(dims: ModelDims, recipe: Recipe) -> int:
    """Image tokens one image becomes at the processor's area cap (the most it can cost)."""
    s = settings_of(dims, min_pixels=recipe.data.min_pixels, max_pixels=recipe.data.max_pixels)
    side = int(math.isqrt(recipe.data.max_pixels))
    return s.tokens_for(side, side)


def images_per_micro_batch(recipe: Recipe) -> int:
    """One image per sample; as many samples as a micro-batch takes (``trainer.micro_batch``)."""
    return max(1, int(recipe.trainer.micro_batch))


def vision_activation_bytes(dims: ModelDims, recipe: Recipe, images: int | None = None, *,
                            inference: bool = False) -> float:
    """The vision tower's activation bytes in one train micro-batch of ``images`` images (see the
    module docstring); ``inference``: a forward without grad (one block's activations live at a time,
    as with a frozen tower); 0 for a text-only model."""
    if not dims.has_vision:
        return 0.0
    c = devmod.compute_bytes(recipe.resources.device, recipe.model.dtype)
    n = images if images is not None else images_per_micro_batch(recipe)
    patches = image_tokens(dims, recipe) * dims.spatial_merge ** 2 * n
    block = patches * c * (10 * dims.vision_hidden + 4 * dims.vision_intermediate)
    merged = patches // dims.spatial_merge ** 2
    merger = merged * c * (3 * dims.vision_hidden * dims.spatial_merge ** 2 + dims.hidden_size)
    blocks = block if inference or recipe.actor.freeze_vision_tower else block * (dims.vision_depth + 1)
    return float(blocks + merger)


#: Qwen2.5-VL's tower: every 8th block attends over the whole image, the others inside windows of
#: 112 x 112 pixels (8 x 8 patches of 14)
FULL_ATTENTION_EVERY, WINDOW_PATCHES = 8, 64


def vision_flops_per_image(dims: ModelDims, recipe: Recipe, tokens: float | None = None) -> float:
    """Forward FLOPs of the vision tower and merger over one image of ``tokens`` image tokens (default:
    the processor's area cap, the memory model's image): 2 per parameter per patch (the merger, which
    runs once per 2 x 2 patches, counted per patch: under 4 % over) and the attention's QK^T and AV,
    windowed in most blocks (``FULL_ATTENTION_EVERY``). 0 for a text-only model."""
    if not dims.has_vision:
        return 0.0
    patches = (image_tokens(dims, recipe) if tokens is None else tokens) * dims.spatial_merge ** 2
    full = dims.vision_depth // FULL_ATTENTION_EVERY
    context = full * patches + (dims.vision_depth - full) * min(patches, WINDOW_PATCHES)
    return patches * (2 * dims.vision_params() + 4 * dims.vision_hidden * context)


def vision_summary(dims: ModelDims, recipe: Recipe, kv_token_bytes: float) -> dict:
    """The plan's image figures: tokens and patches per image, the tower's activations per micro-batch,
    the KV cache bytes of one image's tokens per rollout device."""
    t = image_tokens(dims, recipe)
    return {"image_tokens_per_image": t, "patches_per_image": t * dims.spatial_merge ** 2,
            "images_per_micro_batch": images_per_micro_batch(recipe),
            "vision_params": dims.vision_params(),
            "vision_activations_gib": round(vision_activation_bytes(dims, recipe) / 1024 ** 3, 3),
            "image_kv_cache_mib_per_image": round(t * kv_token_bytes / 1024 ** 2, 2),
            "tower": "frozen" if recipe.actor.freeze_vision_tower else "trained"}


__all__ = ["image_tokens", "images_per_micro_batch", "vision_activation_bytes", "vision_flops_per_image",
           "vision_summary"]
