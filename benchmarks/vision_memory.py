"""The plan's vision-tower activation estimate (``rlrecipes/plan/vision.py``) against a measured peak.

Builds Qwen2.5-VL-7B's real vision tower and merger (width 1280, MLP 3420, 16 heads, merger into
3584) at a reduced block count, runs one real-size image (448 x 448 by default: 256 image tokens,
1,024 patches) forward and backward through it in fp32 on the CPU, and prints one JSON line per
setting: the measured peak of the host memory above the weights (``rlrecipes.device.memory_stats``
over the forward + backward, less the parameters' gradients) and the plan's ``vision_activation_bytes`` for the same image, tower
state and dtype, with their ratio.

    python benchmarks/vision_memory.py [--blocks 2] [--side 448]

Printed, never asserted (speed and memory targets live here, not in tests).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json

import torch

from rlrecipes import device as devmod
from rlrecipes.models import PRESETS, hf_config
from rlrecipes.models.vision import VisionSettings
from rlrecipes.plan.vision import vision_activation_bytes
from rlrecipes.recipe import load_recipe


def measure(blocks: int, side: int, frozen: bool) -> dict:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    dims = dataclasses.replace(PRESETS["qwen2.5-vl-7b"], vision_depth=blocks, num_layers=1, vocab_size=1024)
    cfg = hf_config(dims)
    cfg._attn_implementation = "sdpa"
    cfg.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    visual = Qwen2_5_VLModel(cfg).visual.float()  # the tower and the merger only
    if frozen:
        for n, p in visual.named_parameters():
            p.requires_grad_(n.startswith("merger."))
    img = torch.randint(0, 256, (side, side, 3), dtype=torch.uint8)
    v = VisionSettings().process(img)
    cpu = torch.device("cpu")
    gc.collect()
    try:  # give freed pages back, so the peak shows this call's memory, not the build's reused heap
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    devmod.reset_peak_memory(cpu)
    before = devmod.memory_stats(cpu).peak_bytes
    out = visual(v.pixel_values, grid_thw=v.grid_thw).pooler_output  # [tokens, 3584]
    out = torch.cat(list(out)) if isinstance(out, (list, tuple)) else out
    out.float().square().mean().backward()
    grads = sum(p.numel() * p.element_size() for p in visual.parameters() if p.requires_grad)
    peak = devmod.memory_stats(cpu).peak_bytes - before - grads  # the gradients are not activations
    recipe = load_recipe("qwen25_vl_7b", overrides=["resources.device=cpu", "model.dtype=fp32", "trainer.micro_batch=1",
                                                    f"data.max_pixels={side * side}",
                                                    f"actor.freeze_vision_tower={str(frozen).lower()}"])
    est = vision_activation_bytes(dims, recipe, images=1)
    return {"bench": "vision_memory", "blocks": blocks, "image": f"{side}x{side}", "patches": int(v.pixel_values.shape[0]),
            "tower": "frozen" if frozen else "trained", "grad_bytes": int(grads), "measured_peak_bytes": int(peak), "plan_bytes": int(est),
            "plan_over_measured": round(est / max(peak, 1), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--side", type=int, default=448)
    a = ap.parse_args()
    for frozen in (False, True):
        print(json.dumps(measure(a.blocks, a.side, frozen)), flush=True)


if __name__ == "__main__":
    main()
