"""Vision-language models in the native engines (Qwen2.5-VL, ``Qwen2_5_VLForConditionalGeneration``).

The train engines and the rollout engine call these few functions; a text-only model makes every
one of them a no-op.

* micro-batches (:func:`add_images`): the samples' pixels concatenated in sample order, their image
  grids, and ``[3, b, T]`` M-RoPE positions laid out as the padded ``input_ids`` (left-padded
  prompt, right-padded response), from :func:`rlrecipes.models.vision.mrope_positions` -- the same
  function the rollout uses, so every forward sees the same positions;
* the forward (:func:`forward_inputs`, :func:`touch_vision`): ``pixel_values``, ``image_grid_thw``
  and the positions for the HF model; a micro-batch without images still runs the vision tower on
  one tiny dummy image whose output is added times zero, so every data-parallel rank runs (and
  reduces gradients of) the same modules;
* :func:`freeze_vision_tower`: the patch embedding and the blocks frozen (no grads, no optimizer
  state), the merger trained -- the published runs' setting and ``actor.freeze_vision_tower``'s default;
* the rollout's prefill (:func:`prefill_positions`): the left-padded prompts' ``[3, B, P]``
  positions and each row's next text position, from which every decode step's position follows
  (``next + t`` on all three axes).

The native rollout runs a VL model through HF's ``model.forward`` with a KV cache (prefill with
the pixels, then one token per step): the hand-written fast decoder (``decode.py``) covers plain
decoder stacks, and a VL model's decoder sits under ``model.model.language_model``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from rlrecipes.models.vision import cat_inputs, mrope_positions, padded_positions


class VisionSpec:
    """What the engines need of a VL model's config: the image token and the spatial merge."""

    def __init__(self, config):
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)
        #: never sampled: an image or video token in a response would have no pixels
        self.special_ids = tuple(sorted({self.image_token_id, int(getattr(config, "video_token_id", self.image_token_id))}))
        self.patch_dim = (int(config.vision_config.in_channels) * int(config.vision_config.temporal_patch_size)
                          * int(config.vision_config.patch_size) ** 2)

    def positions(self, ids: torch.Tensor, image, response_len: int = 0) -> torch.Tensor:
        """``[3, P + R]`` positions of one unpadded prompt ``ids [P]`` with its :class:`VisionInput` (or
        None), and of ``response_len`` text tokens after it (the rollout's decode positions)."""
        pos = mrope_positions(ids, None if image is None else image.grid_thw, self.image_token_id, self.merge)
        if response_len:
            nxt = int(pos.max()) + 1 if pos.numel() else 0
            pos = torch.cat([pos, torch.arange(nxt, nxt + response_len).expand(3, -1)], 1)
        return pos


def vision_spec(model: nn.Module) -> Optional[VisionSpec]:
    """The model's :class:`VisionSpec`, None for a text-only model."""
    cfg = getattr(model, "config", None)
    return VisionSpec(cfg) if getattr(cfg, "vision_config", None) is not None else None


def visual_of(model: nn.Module) -> nn.Module:
    return model.model.visual


def freeze_vision_tower(model: nn.Module) -> int:
    """Freeze the vision tower's patch embedding and blocks (the merger trains); the count frozen."""
    visual = visual_of(model)
    n = 0
    for name, p in visual.named_parameters():
        if not name.startswith("merger."):
            p.requires_grad_(False)
            n += p.numel()
    return n


def prepare(model: nn.Module, *, freeze_tower: bool) -> Optional[VisionSpec]:
    """A train engine's setup of a VL model (its spec; the tower frozen when asked); None: text only."""
    spec = vision_spec(model)
    if spec is not None and freeze_tower:
        freeze_vision_tower(model)
    return spec


def add_images(mb: dict, batch, spec: Optional[VisionSpec]) -> None:
    """A padded micro-batch's image inputs (see the module docstring); nothing without images."""
    if spec is None or batch.images is None or not any(v is not None for v in batch.images):
        return
    P = mb["input_ids"].shape[1] - mb["response_mask"].shape[1]
    rows, starts = [], []
    for p, r, img in zip(batch.prompts, batch.responses, batch.images):
        rows.append(spec.positions(p.reshape(-1).long(), img, int(r.numel())))
        starts.append(P - int(p.numel()))
    mb["mrope_position_ids"] = padded_positions(rows, starts, mb["input_ids"].shape[1])  # [3, b, T]
    images = cat_inputs(batch.images)
    if images is not None:
        mb["pixel_values"], mb["image_grid_thw"] = images.pixel_values, images.grid_thw


def add_packed_images(mb: dict, batch, spec: Optional[VisionSpec], order: Sequence[int],
                      rows: Sequence[int], offsets: Sequence[int]) -> None:
    """A packed micro-batch's image inputs: ``[4, rows, L]`` positions (the packed text positions,
    from which transformers reads the samples' boundaries, then the three M-RoPE axes, each sample's
    placed at its row and offset, 0 at row padding) and the pixels in the order the samples are laid
    out (row by row): the model scatters image features into the image tokens in that order."""
    if spec is None or batch.images is None or not any(v is not None for v in batch.images):
        return
    text = mb["position_ids"]  # [rows, L]
    mrope = torch.zeros((3, *text.shape), dtype=torch.long)
    for i, r, off in zip(order, rows, offsets):
        p = batch.prompts[i].reshape(-1).long()
        pos = spec.positions(p, batch.images[i], int(batch.responses[i].numel()))  # [3, P_i + R_i]
        mrope[:, r, off:off + pos.shape[1]] = pos
    mb["mrope_position_ids"] = torch.cat([text[None], mrope])  # [4, rows, L]
    images = cat_inputs([batch.images[i] for i in order])
    if images is not None:
        mb["pixel_values"], mb["image_grid_thw"] = images.pixel_values, images.grid_thw


def pad_positions(pos: torch.Tensor, multiple: int) -> torch.Tensor:
    """``[3, b, T]`` M-RoPE positions right-padded along ``T`` to a multiple of ``multiple``, each axis
    continuing its row's last position (as ``ulysses.pad_to`` does for text positions)."""
    extra = -pos.shape[-1] % multiple
    if not extra:
        return pos
    tail = pos[..., -1:] + torch.arange(1, extra + 1, device=pos.device, dtype=pos.dtype)
    return torch.cat([pos, tail], dim=-1)


@contextmanager
def decoder_columns(model: nn.Module, cols: slice):
    """Sequence parallelism on a VL model: the model embeds the whole row and scatters the image
    features into it (an image's tokens may straddle two ranks' slices, and the vision tower runs
    whole images), then its text decoder runs only on columns ``cols`` of the embeddings and of
    the ``[3, b, T]`` positions. Gradients reach the vision tower and merger from this rank's
    columns only; the SP group's sum is the whole gradient, as for every other parameter."""
    def take(module, args, kwargs):
        kwargs["inputs_embeds"] = kwargs["inputs_embeds"][:, cols]
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = kwargs["position_ids"][..., cols]
        return args, kwargs

    handle = model.model.language_model.register_forward_pre_hook(take, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def forward_inputs(mb: Mapping[str, Any]) -> dict:
    """The model's image keyword arguments of a micro-batch (positions under ``position_ids``)."""
    out = {}
    if "mrope_position_ids" in mb:
        out["position_ids"] = mb["mrope_position_ids"]
    if "pixel_values" in mb:
        out["pixel_values"], out["image_grid_thw"] = mb["pixel_values"], mb["image_grid_thw"]
    return out


def touch_vision(model: nn.Module, spec: VisionSpec, like: torch.Tensor) -> torch.Tensor:
    """Zero times the vision tower's output on one 2x2-merge dummy image: a scalar to add to a
    forward without images, so the tower and merger run (and get zero gradients) on every rank."""
    m = spec.merge
    grid = torch.tensor([[1, m, m]], dtype=torch.long, device=like.device)
    pixels = torch.zeros((m * m, spec.patch_dim), dtype=like.dtype, device=like.device)
    out = model.model.get_image_features(pixels, grid, return_dict=True).pooler_output
    out = torch.cat(list(out)) if isinstance(out, (list, tuple)) else out
    return out.sum() * 0.0


def prefill_positions(spec: VisionSpec, prompts: Sequence[torch.Tensor], images: Sequence[Any],
                      width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[3, B, width]`` positions of left-padded prompts, and ``[B]`` each row's next position."""
    rows = [spec.positions(p.reshape(-1).long(), img) for p, img in zip(prompts, images)]
    pos = padded_positions(rows, [width - r.shape[1] for r in rows], width)
    nxt = torch.tensor([int(r.max()) + 1 if r.numel() else 0 for r in rows], dtype=torch.long)
    return pos, nxt


def image_inputs(images: Sequence[Any], device: torch.device, dtype: torch.dtype) -> dict:
    """``pixel_values`` / ``image_grid_thw`` of a batch's images on ``device`` ({} when none has any)."""
    got = cat_inputs(list(images))
    if got is None:
        return {}
    return {"pixel_values": got.pixel_values.to(device, dtype), "image_grid_thw": got.grid_thw.to(device)}


__all__ = ["VisionSpec", "add_images", "add_packed_images", "decoder_columns", "forward_inputs", "pad_positions", "freeze_vision_tower", "image_inputs", "prefill_positions", "prepare",
           "touch_vision", "vision_spec", "visual_of"]
