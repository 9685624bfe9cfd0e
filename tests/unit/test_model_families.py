"""Each model family is one module; its sharding table is the one source for the TP plan, the
resharder's specs and docs/conventions.md."""
from pathlib import Path

import pytest

from rlrecipes.engines.native.parallel import param_rule, tp_dim
from rlrecipes.models import PRESETS, SMOKE, dims_from_hf_config, hf_config
from rlrecipes.models.families import FAMILY_TABLE
from rlrecipes.models.sharding import kind_of, param_specs, rules_table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "conventions.md"


def test_docs_print_the_table_the_code_uses():
    assert rules_table() in DOCS.read_text(), "regenerate the table in docs/conventions.md with rules_table()"


@pytest.mark.parametrize("family", sorted(FAMILY_TABLE))
def test_every_hf_parameter_has_a_rule_and_engine_agrees_with_specs(family):
    import torch
    from rlrecipes.engines.native.loader import auto_class  # causal LM, or image-text-to-text for a VL family

    dims = SMOKE[family]
    cfg = hf_config(dims)
    model = auto_class(cfg).from_config(cfg)
    names = {n: tuple(p.shape) for n, p in model.state_dict().items()}  # persistent buffers too (router bias)
    specs = {s.name: s for s in param_specs(dims)}
    assert names == {n: s.shape for n, s in specs.items()}, "family hf_params must list exactly the HF parameters"
    rule_of = {"column": "col", "vocab": "vocab", "row": "row", "replicated": "replicate", "expert": "expert"}
    for n, s in specs.items():
        assert param_rule(n) == rule_of[s.kind], n
        assert tp_dim(n) == s.tp_dim, n
    assert dims_from_hf_config(model.config) == dims
    del torch


def test_unknown_module_is_an_error_that_names_the_table():
    with pytest.raises(ValueError, match="families"):
        kind_of("model.layers.0.mlp.mystery_proj.weight")


def test_presets_are_the_families():
    assert {d.family for d in PRESETS.values()} == set(FAMILY_TABLE)
