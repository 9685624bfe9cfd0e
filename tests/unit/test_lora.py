"""LoRA on the native engines (PEFT): adapters train with the base frozen, the base is the reference
policy, only adapters sync to the rollout, the merged export reproduces the trained model."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from rlrecipes.engines.base import AdaptersOff, SeqBatch  # noqa: E402
from rlrecipes.engines.native.rollout import NativeRolloutEngine  # noqa: E402
from rlrecipes.engines.native.train import NativeTrainEngine  # noqa: E402
from rlrecipes.models import SMOKE  # noqa: E402
from rlrecipes.recipe.schema import LoraConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py

LORA = LoraConfig(rank=4, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])


def _batch(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    return SeqBatch([torch.randint(4, 32, (5,), generator=g) for _ in range(n)],
                    [torch.randint(4, 32, (6,), generator=g) for _ in range(n)],
                    per_sample={"advantages": torch.randn(n, generator=g)})


def _train(actor, pg_loss, steps=3):
    for s in range(steps):
        actor.train_step(_batch(s), pg_loss)


def test_only_adapters_train_and_the_base_is_the_reference(pg_loss):
    actor = NativeTrainEngine(SMOKE["qwen2"], role="actor", device="cpu", dtype="fp32", lr=1e-2, lora=LORA)
    plain = NativeTrainEngine(SMOKE["qwen2"], role="ref", device="cpu", dtype="fp32")  # same seed: the base
    trainable = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in actor.optimizer.param_groups) == len(trainable)
    base0 = {n: p.detach().clone() for n, p in actor.model.named_parameters() if not p.requires_grad}
    batch = _batch(9)
    before, _ = actor.forward(batch)
    want, _ = plain.forward(batch)
    for a, b in zip(before, want):  # B = 0: the adapted model starts as the base
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    _train(actor, pg_loss)
    assert all(torch.equal(p, base0[n]) for n, p in actor.model.named_parameters() if not p.requires_grad)
    after, _ = actor.forward(batch)
    assert max(float((a - b).abs().max()) for a, b in zip(after, want)) > 1e-3  # the adapters moved it
    ref, _ = AdaptersOff(actor).forward(batch)  # the reference policy: the base, on the same weights
    for a, b in zip(ref, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert set(actor.local_shards()) == {n for n in trainable}  # what the resharder moves
    assert all(".lora_" in s.name and s.kind == "replicated" for s in actor.param_specs())


@pytest.mark.parametrize("family", ["qwen2", "deepseek_v3"])
def test_synced_adapters_give_the_rollout_the_trainers_log_probs(pg_loss, family):
    actor = NativeTrainEngine(SMOKE[family], role="actor", device="cpu", dtype="fp32", lr=1e-2, lora=LORA)
    rollout = NativeRolloutEngine(SMOKE[family], device="cpu", dtype="fp32", seed=0, lora=LORA)
    _train(actor, pg_loss)
    shards = actor.local_shards()
    full = sum(t.numel() for t in rollout.local_shards().values())
    assert sum(t.numel() for t in shards.values()) < 0.2 * full  # adapters only: a fraction of the weights
    assert rollout.load_shards(shards.items()) == len(shards)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 32, (n,), generator=g) for n in (4, 6)]
    out = rollout.sample(prompts, max_new_tokens=6, seed=3)
    got, _ = actor.forward(SeqBatch(prompts, out.responses))
    for a, b in zip(got, out.log_probs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_merged_export_reproduces_the_trained_model(tmp_path, pg_loss):
    from transformers import AutoModelForCausalLM

    actor = NativeTrainEngine(SMOKE["qwen2"], role="actor", device="cpu", dtype="fp32", lr=1e-2, lora=LORA)
    _train(actor, pg_loss)
    actor.export_hf(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(4, 32, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = actor.model(input_ids=ids).logits
        got = hf(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_plan_refuses_lora_where_it_cannot_run():
    from rlrecipes.plan import build_plan, format_violations
    from rlrecipes.recipe import load_recipe

    ok = build_plan(load_recipe("qwen25_7b", smoke=True, overrides=["actor.lora.rank=8"]))
    assert ok.ok, format_violations(ok)
    for over, words in ((["actor.layout.tp=2"], "actor.layout TP2 EP1"),
                        (["rollout.layout.tp=2"], "rollout.layout TP2 EP1")):
        p = build_plan(load_recipe("qwen25_7b", smoke=True, overrides=["actor.lora.rank=8", *over]))
        assert not p.ok and words in format_violations(p), format_violations(p)
    meg = build_plan(load_recipe("qwen25_7b", overrides=["actor.lora.rank=8"]))  # the published layout: megatron
    assert "actor.engine=megatron does not train or apply LoRA" in format_violations(meg)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(4, 32, (2, 9), generator=torch.Generator().manual_seed(2))


def test_a_real_checkpoint_loads_under_the_adapters(tmp_path):
    """Meta build -> PEFT layers -> materialize: each base weight is read from the checkpoint under its
    HF name (``q_proj.base_layer.weight`` <- ``q_proj.weight``); the adapters start as PEFT starts them,
    the same on every rank."""
    from rlrecipes.engines.native.loader import build_model

    src, _ = build_model(SMOKE["qwen2"], seed=3)
    src.save_pretrained(tmp_path / "src", safe_serialization=True)
    a = NativeTrainEngine(str(tmp_path / "src"), role="actor", device="cpu", dtype="fp32", lora=LORA, seed=5)
    b = NativeTrainEngine(str(tmp_path / "src"), role="actor", device="cpu", dtype="fp32", lora=LORA, seed=5)
    torch.testing.assert_close(_logits(a.model, IDS), _logits(src.eval(), IDS), atol=1e-6, rtol=0)
    lora_a = {n: p for n, p in a.model.named_parameters() if ".lora_A." in n}
    assert lora_a and all(float(p.detach().abs().max()) > 0 for p in lora_a.values())
    assert all(float(p.detach().abs().max()) == 0 for n, p in a.model.named_parameters() if ".lora_B." in n)
    other = dict(b.model.named_parameters())
    assert all(torch.equal(p, other[n]) for n, p in lora_a.items())  # one draw on every rank


def test_checkpoint_holds_the_adapters_and_names_its_base(tmp_path, pg_loss):
    import torch.distributed.checkpoint as dcp

    actor = NativeTrainEngine(SMOKE["qwen2"], role="actor", device="cpu", dtype="fp32", lr=1e-2, lora=LORA)
    _train(actor, pg_loss)
    actor.save(tmp_path / "ck")
    keys = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all(".lora_" in k for k in weights)  # the frozen base stays out
    assert (tmp_path / "ck" / "base_model.json").is_file()
    fresh = NativeTrainEngine(SMOKE["qwen2"], role="actor", device="cpu", dtype="fp32", lr=1e-2, lora=LORA)
    fresh.load(tmp_path / "ck")
    mine = dict(actor.model.named_parameters())
    assert all(torch.equal(p, mine[n]) for n, p in fresh.model.named_parameters())
    _train(actor, pg_loss, steps=1)
    _train(fresh, pg_loss, steps=1)  # the optimizer state came back too: the next step is the same
    assert all(torch.equal(p, mine[n]) for n, p in fresh.model.named_parameters())
    wider = NativeTrainEngine(SMOKE["qwen2"], role="actor", device="cpu", dtype="fp32",
                              lora=LoraConfig(rank=8, target_modules=LORA.target_modules))
    with pytest.raises(ValueError, match="base_model.json: lora is"):
        wider.load(tmp_path / "ck")
    with pytest.raises(ValueError, match="holds LoRA adapters only"):
        NativeTrainEngine(SMOKE["qwen2"], role="actor", device="cpu", dtype="fp32").load(tmp_path / "ck")


def test_adapter_folder_loads_with_peft(tmp_path, pg_loss):
    from peft import PeftModel

    from rlrecipes.engines.native.loader import build_model

    actor = NativeTrainEngine(SMOKE["qwen2"], role="actor", device="cpu", dtype="fp32", lr=1e-2, lora=LORA)
    _train(actor, pg_loss)
    actor.export_adapter(tmp_path / "adapter")
    base, _ = build_model(SMOKE["qwen2"], seed=0)  # the smoke base: built from its dims and seed
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(_logits(peft_model, IDS), _logits(actor.model, IDS), atol=1e-5, rtol=0)
    assert NativeTrainEngine(SMOKE["qwen2"], role="actor", device="cpu", dtype="fp32").export_adapter(
        tmp_path / "none") is None
