"""Image prompts on vLLM (Qwen2.5-VL): the pixels our processor made go straight to vLLM's vision tower.

The rollout hands vLLM what every train-side forward sees: the prompt's token ids (its
``<|image_pad|>`` runs already expanded, one per merged patch) and each image's ``pixel_values``
``[patches, 3 * T * P * P]`` and ``grid_thw`` (``rlrecipes.models.vision.VisionSettings.process``).
No second image processor runs, so none can drift from ours. vLLM 0.32 takes such a request as an
already-processed engine input (``vllm.inputs.engine.mm_input``: token ids with the placeholders in
place, the model's keyword arguments per image, a content hash per image and where each image's
tokens sit) through ``LLMEngine.add_request`` -- the input its own renderer produces from raw images
-- and ``LLMEngine.step`` runs it. vLLM then computes the M-RoPE positions from the placeholders'
offsets and grids (``Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions``: the rule of
``rlrecipes.models.vision.mrope_positions``) and runs its tower on our pixels.

The model class vLLM builds is its own ``Qwen2_5_VLForConditionalGeneration`` (same layers, weight
names and loader), registered under :data:`VL_ARCHITECTURE` with a processing description that
never loads a Hugging Face processor: vLLM builds one at engine start (token budgets, dummy inputs),
and transformers 5's Qwen2-VL image and video processors need torchvision, which the CPU tier
cannot load (``scripts/setup_vllm_cpu.sh``). What that description gives vLLM instead:

- the one modality ``image`` (no video);
- the most tokens one image becomes, from the processor settings the engine passes as
  ``mm_processor_kwargs`` (``max_pixels`` over ``(patch * merge)^2``, at most the sequence), for the
  encoder budget and cache;
- raw images (``multi_modal_data``) are refused with the reason: the rollout never sends them.

Because no dummy images can be made without a processor, the engine is built with
``skip_mm_profiling=True``: vLLM does not measure the vision tower's activations when it sizes the
KV cache (on an accelerator ``gpu_memory_utilization`` must leave that room; ``plan`` notes it).

Where torchvision is missing, vLLM's Qwen2-VL module cannot even be imported (it takes
``smart_resize`` from transformers' torchvision image processor module). :func:`register_model` then
puts transformers' own torchvision-free twin of that module in its place (``Qwen2VLImageProcessorPil``
and the same ``smart_resize``, which transformers marks as copied from it) -- the fallback
transformers itself takes for ``Qwen2VLImageProcessor`` without torchvision. With torchvision
installed nothing is replaced.
"""
from __future__ import annotations

import hashlib
import importlib
import sys
import types
from typing import Any, Optional, Sequence

import torch

#: the architecture name the engine serves a Qwen2.5-VL model under (``hf_overrides``)
VL_ARCHITECTURE = "RLRecipesQwen2_5_VLForConditionalGeneration"
#: Hugging Face architectures served through it
VL_SOURCE_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)

_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_TWIN = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_registered: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# pure: where each image's tokens are, and its identity
def placeholder_ranges(ids: Sequence[int], grid_thw: torch.Tensor, image_token_id: int,
                       spatial_merge: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each image's ``<|image_pad|>`` tokens in ``ids``, in order: image ``k``
    takes the next ``t * h * w / merge^2`` pad tokens (two images in one run of pads split it, as in
    :func:`rlrecipes.models.vision.mrope_positions`). Raises when the pads and the grids disagree."""
    grids = [tuple(int(x) for x in g) for g in grid_thw.reshape(-1, 3).tolist()]
    need = [t * h * w // (spatial_merge * spatial_merge) for t, h, w in grids]
    out: list[tuple[int, int]] = []
    ids = [int(t) for t in ids]
    i, k, L = 0, 0, len(ids)
    while i < L:
        if ids[i] != image_token_id:
            i += 1
            continue
        j = i
        while j < L and ids[j] == image_token_id:
            j += 1
        while i < j:
            if k >= len(need):
                raise ValueError(f"{sum(1 for t in ids if t == image_token_id)} image tokens but {len(grids)} image "
                                 "grid(s): the prompt and its images do not match")
            if i + need[k] > j:
                raise ValueError(f"image {k} needs {need[k]} image tokens, the prompt holds {j - i} there")
            out.append((i, need[k]))
            i += need[k]
            k += 1
    if k != len(need):
        raise ValueError(f"{len(grids)} image grid(s) but the prompt holds {k} image(s)")
    return out


def image_hashes(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[str]:
    """One content hash per image (its grid, dtype and pixel bytes): vLLM keys its encoder cache and
    the prefix cache's blocks by it, so two images share cached work only when their pixels are equal."""
    grids = grid_thw.reshape(-1, 3)
    sizes = grids.prod(-1).tolist()
    px = pixel_values.detach().to("cpu").contiguous()
    out, start = [], 0
    for g, n in zip(grids.tolist(), sizes):
        h = hashlib.sha256()
        h.update(f"rlrecipes-image/{g}/{px.dtype}/{tuple(px.shape[1:])}".encode())
        h.update(px[start:start + n].numpy().tobytes())
        out.append(h.hexdigest())
        start += n
    return out


# ---------------------------------------------------------------------------------------------
# vLLM: the engine input of one image-bearing prompt
def image_request(prompt_ids: Sequence[int], image: Any, *, image_token_id: int, spatial_merge: int,
                  hashes: Optional[list[str]] = None) -> dict:
    """vLLM's processed multimodal engine input (``vllm.inputs.engine.MultiModalInput``) for a prompt
    whose image tokens are expanded and its :class:`~rlrecipes.models.vision.VisionInput` ``image``:
    ``pixel_values`` split per image by its grid (``MultiModalFieldConfig.flat_from_sizes``, what
    vLLM's Qwen2-VL processor declares), ``image_grid_thw`` one row per image (``batched``, kept on
    the host as vLLM's own field config does), the placeholders and the hashes."""
    from transformers import BatchFeature
    from vllm.inputs.engine import mm_input
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems, PlaceholderRange

    ids = [int(t) for t in prompt_ids]
    grid = image.grid_thw.reshape(-1, 3).to(torch.long)
    pixels = image.pixel_values.float()  # [patches, patch_dim]
    if int(grid.prod(-1).sum()) != int(pixels.shape[0]):
        raise ValueError(f"images of {int(grid.prod(-1).sum())} patches by their grids, but pixel_values holds "
                         f"{int(pixels.shape[0])}")
    ranges = placeholder_ranges(ids, grid, image_token_id, spatial_merge)
    fields = {"pixel_values": MultiModalFieldConfig.flat_from_sizes("image", grid.prod(-1)),
              "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True)}
    items = MultiModalKwargsItems.from_hf_inputs(BatchFeature({"pixel_values": pixels, "image_grid_thw": grid}),
                                                 fields)
    return mm_input(ids, items, {"image": hashes or image_hashes(pixels, grid)},
                    {"image": [PlaceholderRange(offset=o, length=n) for o, n in ranges]})


def text_request(prompt_ids: Sequence[int]) -> dict:
    """vLLM's token engine input (``vllm.inputs.engine.tokens_input``) of a prompt without images."""
    from vllm.inputs.engine import tokens_input

    return tokens_input([int(t) for t in prompt_ids])


# ---------------------------------------------------------------------------------------------
# vLLM: the model class, registered once per process
def _torchvision_free_processor_module() -> None:
    """Without torchvision, put transformers' torchvision-free Qwen2-VL image processor module where
    vLLM imports ``smart_resize`` from (see the module docstring); with it, change nothing."""
    try:
        importlib.import_module(_TORCHVISION_MODULE)
        return
    except ModuleNotFoundError as e:
        if not (e.name or "").split(".")[0] == "torchvision":
            raise
    twin = importlib.import_module(_PIL_TWIN)
    stand_in = types.ModuleType(_TORCHVISION_MODULE)
    stand_in.__doc__ = f"rlrecipes: torchvision is not installed; {_PIL_TWIN} stands in (same smart_resize)"
    stand_in.smart_resize = twin.smart_resize
    stand_in.Qwen2VLImageProcessor = twin.Qwen2VLImageProcessorPil
    sys.modules[_TORCHVISION_MODULE] = stand_in


def register_model() -> str:
    """Register vLLM's Qwen2.5-VL model under :data:`VL_ARCHITECTURE` with the processing description
    of the module docstring (``ModelRegistry.register_model``, ``MULTIMODAL_REGISTRY.register_processor``);
    idempotent. Returns the architecture name to pass in ``hf_overrides``."""
    global _registered
    if _registered is not None:
        return _registered
    _torchvision_free_processor_module()
    from vllm import ModelRegistry
    from vllm.model_executor.models import qwen2_5_vl as q
    from vllm.multimodal import MULTIMODAL_REGISTRY

    class PreprocessedImagesInfo(q.Qwen2_5_VLProcessingInfo):
        """Images only, already processed by rlrecipes; no Hugging Face processor is loaded."""

        def get_supported_mm_limits(self):
            return {"image": None}

        def get_mm_max_tokens_per_item(self, seq_len, mm_counts):
            vc = self.get_hf_config().vision_config
            factor = int(vc.patch_size) * int(vc.spatial_merge_size)
            max_pixels = (self.ctx.get_mm_config().mm_processor_kwargs or {}).get("max_pixels")
            most = max(1, int(max_pixels) // (factor * factor)) if max_pixels else int(seq_len)
            return {"image": min(most, int(seq_len))}

        def get_hf_processor(self, **kwargs):
            raise RuntimeError("rlrecipes serves Qwen2.5-VL on vLLM with images its own processor made "
                               "(rlrecipes.engines.vllm.vision.image_request); raw images are not processed here")

    class PreprocessedImagesProcessor(q.Qwen2_5_VLMultiModalProcessor):
        requires_tokenizer = False  # the rollout sends token ids (skip_tokenizer_init=True)

    @MULTIMODAL_REGISTRY.register_processor(PreprocessedImagesProcessor, info=PreprocessedImagesInfo,
                                            dummy_inputs=q.Qwen2_5_VLDummyInputsBuilder)
    class RLRecipesQwen2_5_VL(q.Qwen2_5_VLForConditionalGeneration):
        """vLLM's Qwen2.5-VL, unchanged; only its processing description differs (module docstring)."""

    ModelRegistry.register_model(VL_ARCHITECTURE, RLRecipesQwen2_5_VL)
    _registered = VL_ARCHITECTURE
    return _registered


__all__ = ["VL_ARCHITECTURE", "VL_SOURCE_ARCHITECTURES", "image_hashes", "image_request", "placeholder_ranges",
           "register_model", "text_request"]
