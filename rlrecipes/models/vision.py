"""Qwen2.5-VL image inputs: the processor (pixels -> patches, the image grid, the image tokens of a
prompt) and the M-RoPE positions, written against the vision settings of a
:class:`~rlrecipes.models.dims.ModelDims` so that every stage computes them the same way.

* :class:`VisionSettings` -- patch size, spatial merge, temporal patch, the pixel budget
  (``min_pixels`` / ``max_pixels``) and the normalisation; ``tokens_for(h, w)`` is how many image
  tokens one image becomes (what ``plan`` counts);
* :func:`smart_resize` and :meth:`VisionSettings.process` -- an ``[H, W, 3]`` uint8 image ->
  :class:`VisionInput` (``pixel_values [N, 3 * T * P * P]`` in the vision tower's patch order and
  ``grid_thw [1, 3]``), the layout ``Qwen2VLImageProcessor`` produces (resize to a multiple of
  ``patch * merge``, rescale, normalise, the image repeated to ``temporal_patch_size`` frames,
  patches grouped by merge window). Written here in torch so nothing needs Pillow or torchvision;
* :func:`mrope_positions` -- the 3-D (temporal, height, width) positions of one unpadded sequence,
  the rule of ``Qwen2_5_VLModel.get_rope_index`` for still images: text advances all three by one,
  an image's tokens take ``start + (t, h, w)`` over its merged grid and the text after it resumes at
  ``start + max(h, w)``. The rollout (prefill and every decode step) and every train-side forward
  use this one function, so they see the same positions.

An image-bearing prompt's text holds ``<|vision_start|>`` + ``tokens_for(h, w)`` x ``<|image_pad|>``
+ ``<|vision_end|>`` per image (:meth:`VisionSettings.placeholder`); the model replaces the pad
tokens' embeddings by the merger's outputs, in order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

#: OpenAI CLIP normalisation, the Qwen2-VL / Qwen2.5-VL image processor's
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"


@dataclass(frozen=True)
class VisionInput:
    """One sample's images as the vision tower takes them (host tensors, shared by every stage that
    reads the sample: built once per worker and referenced, never copied per stage)."""

    pixel_values: torch.Tensor
    """``[patches, 3 * temporal_patch * patch * patch]`` float32, all images of the sample in order."""
    grid_thw: torch.Tensor
    """``[images, 3]`` int64: (t, h, w) patch grid of each image (before the spatial merge)."""

    @property
    def num_images(self) -> int:
        return int(self.grid_thw.shape[0])


def cat_inputs(items: Sequence[VisionInput | None]) -> VisionInput | None:
    """The images of several samples, in sample order (None when none has any)."""
    got = [v for v in items if v is not None and v.num_images]
    if not got:
        return None
    return VisionInput(torch.cat([v.pixel_values for v in got]), torch.cat([v.grid_thw for v in got]))


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Height and width, multiples of ``factor``, with the aspect ratio kept as far as the rounding allows
    and the area inside ``[min_pixels, max_pixels]`` (Qwen2-VL's rule)."""
    if min(h, w) < 1:
        raise ValueError(f"image of {h}x{w} pixels: both sides must be at least 1")
    if max(h, w) / min(h, w) > 200:
        raise ValueError(f"image of {h}x{w} pixels: aspect ratio above 200; crop or pad it")
    hb, wb = max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor)
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def settings_of(dims, **overrides) -> "VisionSettings":
    """The processor settings of a VL model's dims (``min_pixels`` / ``max_pixels`` from the recipe)."""
    return VisionSettings(patch_size=dims.patch_size, spatial_merge=dims.spatial_merge,
                          temporal_patch=dims.temporal_patch, **overrides)


@dataclass(frozen=True)
class VisionSettings:
    """The processor's settings (Qwen2.5-VL defaults: 14-pixel patches, 2x2 merge, 2 frames per patch)."""

    patch_size: int = 14
    spatial_merge: int = 2
    temporal_patch: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @property
    def factor(self) -> int:
        return self.patch_size * self.spatial_merge

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch * self.patch_size ** 2

    def resized(self, h: int, w: int) -> tuple[int, int]:
        return smart_resize(h, w, self.factor, self.min_pixels, self.max_pixels)

    def tokens_for(self, h: int, w: int) -> int:
        """Image tokens (merged patches) one ``h x w`` image becomes."""
        hb, wb = self.resized(h, w)
        return (hb // self.factor) * (wb // self.factor)

    def patches_for(self, h: int, w: int) -> int:
        """Patches the vision tower runs on for one ``h x w`` image (tokens x merge^2)."""
        return self.tokens_for(h, w) * self.spatial_merge ** 2

    def placeholder(self, grid_thw: Sequence[int]) -> str:
        t, gh, gw = (int(x) for x in grid_thw)
        n = t * gh * gw // self.spatial_merge ** 2
        return VISION_START + IMAGE_PAD * n + VISION_END

    @staticmethod
    def cat(items: Sequence[VisionInput | None]) -> VisionInput | None:
        return cat_inputs(items)

    def process(self, image) -> VisionInput:
        """One ``[H, W, 3]`` uint8 image (numpy array or tensor) -> its patches and grid."""
        img = torch.as_tensor(image)
        if img.dim() == 2:  # grey
            img = img[:, :, None].expand(-1, -1, 3)
        if img.dim() != 3 or img.shape[2] not in (3, 4):
            raise ValueError(f"image of shape {tuple(img.shape)}: expected [height, width, 3] (RGB)")
        img = img[:, :, :3].permute(2, 0, 1).float()  # [3, H, W]
        h, w = int(img.shape[1]), int(img.shape[2])
        hb, wb = self.resized(h, w)
        if (hb, wb) != (h, w):
            img = F.interpolate(img[None], size=(hb, wb), mode="bicubic", align_corners=False,
                                antialias=True)[0].clamp_(0, 255)
        x = img / 255.0
        x = (x - torch.tensor(IMAGE_MEAN)[:, None, None]) / torch.tensor(IMAGE_STD)[:, None, None]  # [3, hb, wb]
        T, P, m = self.temporal_patch, self.patch_size, self.spatial_merge
        x = x[None].expand(T, -1, -1, -1)  # a still image is T identical frames [T, 3, hb, wb]
        gt, gh, gw = 1, hb // P, wb // P
        x = x.reshape(gt, T, 3, gh // m, m, P, gw // m, m, P)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # merge windows, then channel, frame, pixel rows, columns
        pixels = x.reshape(gt * gh * gw, 3 * T * P * P).contiguous()  # [patches, patch_dim]
        return VisionInput(pixels, torch.tensor([[gt, gh, gw]], dtype=torch.long))


def mrope_positions(ids: torch.Tensor, grid_thw: torch.Tensor | None, image_token_id: int,
                    spatial_merge: int) -> torch.Tensor:
    """``[3, L]`` M-RoPE positions of one unpadded token sequence ``ids [L]`` whose runs of
    ``image_token_id`` are the images of ``grid_thw [images, 3]``, in order."""
    ids = ids.reshape(-1)
    L = int(ids.numel())
    out = torch.empty((3, L), dtype=torch.long)
    is_img = (ids == image_token_id).tolist()
    grids = [] if grid_thw is None else [tuple(int(v) for v in g) for g in grid_thw.reshape(-1, 3)]
    i = cur = k = 0
    while i < L:
        j = i
        while j < L and is_img[j] == is_img[i]:
            j += 1
        if not is_img[i]:
            out[:, i:j] = torch.arange(cur, cur + j - i)[None]
            cur += j - i
        else:
            while i < j:  # consecutive images would share one run: take each image's own count
                if k >= len(grids):
                    raise ValueError(f"{sum(is_img)} image tokens but only {len(grids)} image grid(s); the prompt "
                                     "and its images do not match")
                t, gh, gw = grids[k]
                gh, gw = gh // spatial_merge, gw // spatial_merge
                n = t * gh * gw
                if i + n > j:
                    raise ValueError(f"image {k} needs {n} image tokens, the prompt holds {j - i}")
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
                out[:, i:i + n] = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
                cur += max(gh, gw)
                i += n
                k += 1
        i = j
    if k != len(grids):
        raise ValueError(f"{len(grids)} image grid(s) but the tokens hold {k} image(s)")
    return out


def padded_positions(rows: Sequence[torch.Tensor], starts: Sequence[int], width: int) -> torch.Tensor:
    """``[3, b, width]``: each row's ``[3, L_i]`` positions placed at columns ``starts[i] .. + L_i`` (0 elsewhere)."""
    out = torch.zeros((3, len(rows), width), dtype=torch.long)
    for i, (p, s) in enumerate(zip(rows, starts)):
        out[:, i, s:s + p.shape[1]] = p
    return out


__all__ = ["IMAGE_MEAN", "IMAGE_PAD", "IMAGE_STD", "VISION_END", "VISION_START", "VisionInput", "VisionSettings",
           "cat_inputs", "mrope_positions", "settings_of", "padded_positions", "smart_resize"]
