"""``rlrecipes plan`` with ``actor.lora`` (issue 33): the adapter tensors PEFT creates, counted from
the model's dimensions; memory with the base frozen and no reference model; the per-step sync of
the adapters only, beside a full-weight sync."""
import warnings

import pytest

from rlrecipes.models import SMOKE, param_specs, smoke_dims
from rlrecipes.models.lora_shapes import lora_shapes
from rlrecipes.plan import build_plan, format_violations
from rlrecipes.recipe import load_recipe
from rlrecipes.recipe.schema import LoraConfig

SMOKE_RECIPES = {"qwen2": "qwen25_7b", "qwen3_moe": "qwen3_moe_30b", "deepseek_v3": "deepseek_r1_671b",
                 "qwen2_5_vl": "qwen25_vl_7b"}
DEFAULT_TARGETS = LoraConfig().target_modules


def _peft_lora(dims, lora) -> dict:
    """name -> shape of every LoRA tensor ``peft.inject_adapter_in_model`` puts into the HF model."""
    pytest.importorskip("peft")
    import torch
    from peft import inject_adapter_in_model
    from rlrecipes.engines.native.loader import auto_class
    from rlrecipes.engines.native.lora import is_lora_name, peft_config
    from rlrecipes.models.catalog import hf_config

    torch.manual_seed(0)
    cfg = hf_config(dims)
    model = auto_class(cfg).from_config(cfg)  # a VL family: its image-text-to-text class
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's v4 -> v5 MoE target conversion warns about its rank pattern
        model = inject_adapter_in_model(peft_config(lora), model)
    return {n: tuple(p.shape) for n, p in model.named_parameters() if is_lora_name(n)}


def _smoke_targets(family: str) -> list[str]:
    return list(load_recipe(SMOKE_RECIPES[family], smoke=True).actor.lora.target_modules)


@pytest.mark.parametrize("family", sorted(SMOKE))
@pytest.mark.parametrize("targets", ["smoke", "default"])
def test_lora_shapes_equal_what_peft_creates_on_the_smoke_models(family, targets):
    lora = LoraConfig(rank=8, target_modules=_smoke_targets(family) if targets == "smoke" else DEFAULT_TARGETS)
    dims = SMOKE[family]
    mine = lora_shapes(dims, lora)
    assert dict(mine) == _peft_lora(dims, lora)
    assert len(dict(mine)) == len(mine)
    specs = param_specs(dict(mine))  # the resharder's specs: adapters sync whole
    assert [s.name for s in specs] == [n for n, _ in mine] and {s.kind for s in specs} == {"replicated"}


def test_lora_shapes_of_moe_families_adapt_the_fused_experts_as_parameters():
    """PEFT 0.21 re-targets gate/up/down_proj of Qwen3-MoE and DeepSeek-V3 at the fused 3-D experts
    (rank x experts, doubled for gate_up_proj); DeepSeek's dense MLPs then get no adapter."""
    d = SMOKE["deepseek_v3"]
    shapes = dict(lora_shapes(d, LoraConfig(rank=4)))
    E, I, H = d.num_experts, d.moe_intermediate_size, d.hidden_size
    assert shapes["model.layers.1.mlp.experts.base_layer.lora_A.default.weight"] == (2 * 4 * E, H)  # gate_up_proj
    assert shapes["model.layers.1.mlp.experts.base_layer.lora_B.default.weight"] == (2 * I, 2 * 4 * E)
    assert shapes["model.layers.1.mlp.experts.lora_A.default.weight"] == (4 * E, I)  # down_proj
    assert not any(".mlp.gate_proj." in n or ".shared_experts." in n for n in shapes)


@pytest.mark.parametrize("dims, lora", [
    (smoke_dims("qwen2", tie_embeddings=True), LoraConfig(rank=4, target_modules=["lm_head", "o_proj"])),
    (smoke_dims("qwen3_moe", moe_intermediate_size=48), LoraConfig(rank=4, target_modules=["gate", "down_proj",
                                                                                          "up_proj", "gate_proj"])),
    (smoke_dims("deepseek_v3"), LoraConfig(rank=4, target_modules=["q_a_proj", "kv_b_proj", "mlp.up_proj",
                                                                   "shared_experts.gate_proj"])),
])
def test_lora_shapes_equal_peft_on_tied_heads_routers_and_partial_names(dims, lora):
    assert dict(lora_shapes(dims, lora)) == _peft_lora(dims, lora)


@pytest.mark.parametrize("family, targets", [("qwen2", ["nope"]), ("qwen2", ["self_attn"]),
                                             ("qwen3_moe", ["gate_proj"]), ("qwen3_moe", ["experts"])])
def test_lora_shapes_refuse_what_peft_refuses(family, targets):
    lora = LoraConfig(rank=4, target_modules=targets)
    with pytest.raises(ValueError):
        lora_shapes(SMOKE[family], lora)
    with pytest.raises(ValueError):  # (PEFT's NoMatchingPeftModuleError is a ValueError too)
        _peft_lora(SMOKE[family], lora)


# ---- plan ------------------------------------------------------------------------------------
def _native_7b(*extra):
    """The real qwen25_7b recipe on the engines that train LoRA (native, TP1 PP1): DP16 on 16 dies."""
    return load_recipe("qwen25_7b", overrides=["actor.engine=native", "rollout.engine=native", "actor.layout.tp=1",
                                               "actor.layout.pp=1", *extra])


def _adapter_params_7b(rank: int) -> int:
    """Default targets on Qwen2.5-7B, from the published shape: r x (in + out) per adapted Linear."""
    H, kv, inter, layers = 3584, 4 * 128, 18944, 28
    linears = [(H, H), (H, kv), (H, kv), (H, H), (H, inter), (H, inter), (inter, H)]  # q k v o gate up down
    return layers * rank * sum(i + o for i, o in linears)


def test_lora_plan_counts_adapter_gradients_and_optimizer_state_and_no_reference_weights():
    full, lora = build_plan(_native_7b()), build_plan(_native_7b("actor.lora.rank=8"))
    assert full.ok and lora.ok, format_violations(lora)
    dp = lora.roles["actor"].dp
    assert dp == 16
    adapters = _adapter_params_7b(8)
    assert lora.lora["params"] == adapters and lora.lora["tensors"] == 28 * 7 * 2
    m, f = lora.train_memory, full.train_memory
    assert m.grads == pytest.approx(4 * adapters / dp) and m.optimizer == pytest.approx(8 * adapters / dp)
    assert m.weights == pytest.approx(f.weights + 4 * adapters / dp)  # the frozen base stays fp32, sharded
    assert m.activations == f.activations and 0 < m.transient < f.transient
    assert build_plan(_native_7b("actor.lora.rank=8", "actor.offload_optimizer=true")).train_memory.optimizer == 0
    # the reference policy is the actor with its adapters off: the role runs, no weights of its own
    assert "ref" in lora.roles and lora.ref_policy == "adapters off" and lora.ref_memory.total == 0
    assert full.ref_policy == "model" and full.ref_memory.weights == pytest.approx(2 * 7.62e9 / dp, rel=0.01)
    j = lora.to_json()
    assert j["ref_policy"] == "adapters off" and j["ref_memory_gib"]["total"] == 0
    assert j["lora"]["params"] == adapters


def test_lora_plan_rendering_shows_no_reference_memory():
    from rlrecipes.cli._common import console
    from rlrecipes.cli.plan import render_plan

    def text(plan):
        with console.capture() as cap:
            render_plan(plan)
        return cap.get()

    full, lora = text(build_plan(_native_7b())), text(build_plan(_native_7b("actor.lora.rank=8")))
    assert "+ ref" in full and "+ ref" not in lora
    assert "adapters off (no reference weights)" in lora and "a full-weight sync" in lora


def test_lora_reshard_moves_the_adapters_only():
    """The real qwen25_7b recipe with actor.lora.rank=8: the per-step sync is under 5 % of a
    full-weight sync, colocated (bytes loaded into each rollout device) and disaggregated (bytes a
    rollout device receives)."""
    p = build_plan(_native_7b("actor.lora.rank=8"))
    sync = p.lora["reshard"]
    adapters, full = sync["adapters"], sync["full_weights"]
    assert adapters["method"] == full["method"] == "resharder plan"
    assert adapters["loaded"] == 2 * _adapter_params_7b(8)  # bf16, whole on every rollout device
    assert full["loaded"] == pytest.approx(2 * 7.62e9, rel=0.01)
    assert adapters["loaded"] <= 0.05 * full["loaded"]
    assert p.reshard_bytes_per_device == adapters["received"] == 0  # colocated TP1: each device holds them
    d = build_plan(_native_7b("actor.lora.rank=8", "resources.placement=disaggregated",
                              "resources.rollout_devices=8"))
    assert d.ok, format_violations(d)
    da, df = d.lora["reshard"]["adapters"], d.lora["reshard"]["full_weights"]
    assert da["received"] == da["loaded"] == adapters["loaded"] and 0 < da["sent"]
    assert 0 < da["received"] <= 0.05 * df["received"] and d.reshard_bytes_per_device == da["received"]
    assert d.to_json()["lora"]["reshard"]["loaded_fraction_of_full"] < 0.05


@pytest.mark.parametrize("family", sorted(SMOKE))
def test_smoke_plans_with_lora_count_the_tensors_the_engine_syncs(family):
    r = load_recipe(SMOKE_RECIPES[family], smoke=True, overrides=["actor.lora.rank=8", "actor.layout.tp=1",
                                                                 "actor.layout.ep=1", "rollout.layout.tp=1",
                                                                 "rollout.layout.ep=1"])
    p = build_plan(r)
    assert p.ok, format_violations(p)
    peft = _peft_lora(r.model.dims(), r.actor.lora)
    assert p.lora["tensors"] == len(peft) and p.lora["params"] == sum(a * b for a, b in peft.values())


def test_lora_targets_peft_refuses_are_a_plan_violation():
    p = build_plan(_native_7b("actor.lora.rank=8", "actor.lora.target_modules=[nope]"))
    assert any(v.rule == "LoRA has what it needs" and "nope" in v.detail for v in p.violations), p.violations


@pytest.mark.parametrize("family,device", [("qwen3_moe", "cuda"), ("qwen3_moe", "npu"), ("deepseek_v3", "cuda")])
def test_moe_expert_adapters_on_vllm_are_refused_with_the_targets_it_serves(family, device):
    """Issue 45, item 1: PEFT saves expert adapters as fused 3-D ``mlp.experts(.base_layer)`` tensors,
    which vLLM 0.32 refuses for Qwen3-MoE / DeepSeek and vLLM 0.23 misreads: ``plan`` refuses them on
    every device and names the attention projections; those pass."""
    from rlrecipes.engines.vllm.args import attention_targets

    base = ["actor.lora.rank=8", "actor.layout.tp=1", "actor.layout.ep=1", "rollout.layout.tp=1",
            "rollout.layout.ep=1", "rollout.engine=vllm", f"resources.device={device}"]
    r = load_recipe(SMOKE_RECIPES[family], smoke=True, overrides=base)
    refused = [v.detail for v in build_plan(r).violations if "adapt the MoE experts" in v.detail]
    assert len(refused) == 1, build_plan(r).violations
    fix = [t for t in r.actor.lora.target_modules if t not in ("gate_proj", "up_proj", "down_proj")]
    assert f"actor.lora.target_modules=[{','.join(fix)}]" in refused[0] and "rollout.engine=native" in refused[0]
    attention = attention_targets(r.model.dims())
    assert "kv_b_proj" not in attention
    ok = load_recipe(SMOKE_RECIPES[family], smoke=True,
                     overrides=[*base, f"actor.lora.target_modules=[{','.join(attention)}]"])
    assert not [v for v in build_plan(ok).violations if "lora" in v.detail.lower()], build_plan(ok).violations
