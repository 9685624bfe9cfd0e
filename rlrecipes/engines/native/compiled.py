"""``torch.compile`` of the decoder layers: the native train engine's ``compile_layers`` option.

Per decoder layer, after TP / EP and FSDP2 wrapping (the per-block compile torchtitan does, written
here for HF layers): each layer's ``forward`` becomes ``torch.compile(forward)``; the module, its
parameters and their names stay as they are (no ``_orig_mod`` wrapper), so shards, checkpoints and
HF exports do not change.

* Outside the compiled region: the hooks ``nn.Module.__call__`` runs (FSDP2's all-gather before the
  layer and reshard after it, explicit prefetch), so FSDP2 works as in eager.
* Inside: the layer's body; with recompute, transformers' activation checkpoint where transformers
  checkpoints ``forward`` (5.24: ``GradientCheckpointingLayer.__init_subclass__``), which dynamo
  traces as a checkpointed region; where it checkpoints ``__call__`` (5.5 .. 5.19) the compiled
  forward runs inside the checkpoint. Either way the values are eager's (tests).
* The layers of one class share their compiled graphs (dynamo guards on the module's class and the
  parameters' metadata, not on its identity): a 28-layer model compiles as often as a 1-layer one,
  once per mode (training, no-grad forward) and input signature. Shapes are static at first and
  become dynamic on the first change (``dynamic=None``), so packed micro-batches of varying length
  cost one more compile, not one per length.
* MoE experts at EP 1 compile with transformers' grouped-GEMM path; where the op cannot run under
  compile (non-bf16 weights) transformers' own per-expert fallback is an opaque custom op.

Not with TP, EP or Ulysses SP in this release (their collectives and data-dependent splits inside
the layer are not traced here); the engine refuses those layouts.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from rlrecipes import device as devmod

RECOMPILE_LIMIT = 32
"""Compiled variants dynamo keeps per code object (torch's default is 8). All decoder layers of
transformers >= 5.24 run one wrapper frame (``forward_with_checkpointing``), so its variants add up
over layer classes (DeepSeek's dense and MoE layers), modes (training, no-grad) and the first shape
change; past the limit dynamo silently runs the frame eagerly."""


def backend_of(option: bool | str) -> str | None:
    """The ``torch.compile`` backend an engine's ``compile_layers`` option names: False/None -> None
    (eager), True -> ``"inductor"``, a string -> that backend (``"aot_eager"``: graph capture and
    AOTAutograd without code generation, what the CPU tests use)."""
    if option is None or option is False:
        return None
    if option is True:
        return "inductor"
    if isinstance(option, str) and option:
        return option
    raise ValueError(f"compile_layers={option!r}: expected true / false or a torch.compile backend name")


def text_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM (a VL model's language layers; its vision blocks stay eager)."""
    backbone = getattr(model, "model", model)
    backbone = getattr(backbone, "language_model", backbone)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise ValueError(f"compile_layers: {type(model).__name__} has no decoder layers (.model.layers)")
    return list(layers)


def compile_layers(model: nn.Module, device: torch.device, backend: str) -> list[nn.Module]:
    """Replace every decoder layer's ``forward`` with its compiled version; returns the layers.

    Raises ``RuntimeError`` naming what is missing when ``backend`` cannot generate code for ``device``
    here (:func:`rlrecipes.device.compile_problem`: no C++ compiler for inductor on the CPU, no
    Triton on CUDA): nothing is compiled then, rather than failing at the first step."""
    problem = devmod.compile_problem(device, backend)
    if problem is not None:
        raise RuntimeError(f"compile_layers (torch.compile backend {backend!r}) cannot run here: {problem}; "
                           "set compile_layers=False")
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    layers = text_layers(model)
    for layer in layers:
        if getattr(layer, "_rlr_compiled", False):
            continue
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=None)
        layer._rlr_compiled = True
    return layers


__all__ = ["RECOMPILE_LIMIT", "backend_of", "compile_layers", "text_layers"]
