"""LoRA smoke runs through the installed CLI: adapter-only checkpoints that resume bit-identically, the
weight sync's real volume, and the two exports (a PEFT adapter folder and the merged HF folder)."""
import json

import pytest
import torch

from test_smoke_runs import cli, metrics

pytest.importorskip("peft")
pytestmark = pytest.mark.e2e

LORA = ("actor.lora.rank=8",)


def test_lora_run_resumes_bit_identically_and_exports_both_folders(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.models import SMOKE

    a, b = tmp_path / "a", tmp_path / "b"
    cli("run", "qwen25_7b", "--smoke", "--steps", "5", "--out", str(a), "--quiet", *LORA)
    # b checkpoints after step 1 and stops there, then resumes for the last 3 steps
    cli("run", "qwen25_7b", "--smoke", "--steps", "2", "--out", str(b), "--quiet", *LORA, "trainer.checkpoint_interval=2")
    ckpt = b / "checkpoints" / "step_000002" / "actor"
    ref = json.loads((ckpt / "base_model.json").read_text())
    assert ref["lora"]["rank"] == 8 and ref["base_model"]["smoke_dims"]["family"] == "qwen2"
    held = sum(f.stat().st_size for f in ckpt.glob("*.distcp"))
    full = metrics(a)[0]["reshard/full_bytes"]
    assert held < 1.5 * full  # adapters + their Adam moments (a full-model one holds 3x the weights)
    cli("run", "qwen25_7b", "--smoke", "--steps", "5", "--resume", str(b), "--quiet")
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [0, 1, 2, 3, 4]
    for x, y in zip(ra[2:], rb[2:]):
        for k in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/kl", "perf/tokens"):
            assert x[k] == y[k], (x["step"], k, x[k], y[k])
    wa, wb = (load_file(str(r / "actor_adapter" / "adapter_model.safetensors")) for r in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # only adapters moved: the volume each step is theirs, not the model's
    for r in ra:
        assert 0 < r["reshard/bytes"] < r["reshard/full_bytes"] / 3
    # the merged export and the adapter on its base are the same model
    base, _ = build_model(SMOKE["qwen2"], seed=ref["base_model"]["seed"])  # the smoke base: dims + seed
    peft_model = PeftModel.from_pretrained(base, str(a / "actor_adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(a / "actor_hf"), dtype=torch.float32).eval()
    ids = torch.randint(4, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft_model(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_disaggregated_lora_moves_adapters_across_the_bridge(tmp_path):
    """Both sides plan the bridge from the adapters' shapes (no model on the planning side)."""
    run = tmp_path / "d"
    cli("run", "qwen25_7b", "--smoke", "--steps", "2", "--out", str(run), "--quiet", *LORA,
        "resources.placement=disaggregated", "resources.rollout_devices=1")
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1]
    # step 1 uses the version step 0 trained: the adapters crossed, a fifth of this tiny model
    assert 0 < rows[1]["reshard/bytes"] < rows[1]["reshard/full_bytes"] / 3
