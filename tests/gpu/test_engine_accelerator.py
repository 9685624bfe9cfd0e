"""The native train engine on an accelerator (CUDA or NPU): bf16 mixed precision through FSDP2 with
fp32 masters, the sharded loader, packed micro-batches. Skipped on hosts without one (CI)."""
import dataclasses
import socket

import pytest
import torch

from rlrecipes import device as devmod

KIND = devmod.accelerator()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(KIND is None, reason="needs a CUDA or NPU device")]


@pytest.fixture(scope="module")
def accel_group():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dev = devmod.torch_device(KIND)
    devmod.set_device(dev)
    dist.init_process_group(devmod.comm_backend(KIND), init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=dev)
    yield dev
    dist.destroy_process_group()


def test_bf16_mixed_precision_step_from_a_folder(tmp_path, accel_group, random_seq_batch, pg_loss):
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.engines.native.train import NativeTrainEngine
    from rlrecipes.models import SMOKE

    dims = dataclasses.replace(SMOKE["qwen2"], tie_embeddings=True)
    src, _ = build_model(dims, seed=5)
    src.save_pretrained(tmp_path / "src", safe_serialization=True)
    eng = NativeTrainEngine(str(tmp_path / "src"), layout=(1, 1), device=accel_group, dtype="bf16", lr=1e-3,
                            max_tokens_per_micro_batch=32)
    assert eng.fsdp and eng.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in eng.model.parameters())  # fp32 masters
    assert eng.model.lm_head.weight is eng.model.get_input_embeddings().weight
    batch = random_seq_batch(dims.vocab_size)
    ref = NativeTrainEngine(str(tmp_path / "src"), layout=(1, 1), device="cpu", dtype="fp32", role="ref")
    logp_cpu, _ = ref.forward(batch)
    logp, _ = eng.forward(batch)  # packed micro-batches, per-sample [R_i] on the host
    assert all(a.dtype == torch.float32 and a.shape == b.shape for a, b in zip(logp, logp_cpu))
    diff = max(float((a - b).abs().max()) for a, b in zip(logp, logp_cpu))
    assert diff < 0.1, diff  # bf16 compute against the fp32 CPU model
    assert all(hasattr(p, "full_tensor") for p in eng.model.parameters())  # resharded after inference
    before = eng.full_state_dict()
    m = eng.train_step(batch, pg_loss)
    assert m["actor/skipped_step"] == 0.0 and m["actor/micro_batches"] >= 2
    assert torch.isfinite(torch.tensor(m["actor/grad_norm"]))
    after = eng.full_state_dict()
    assert sum(not torch.equal(before[k], after[k]) for k in before) == len(before)


def _two_steps(dims, dev, **kw):
    """bf16 engine (FSDP2, fp32 masters): no-grad log-probs, then one train step (issue 49's options)."""
    from rlrecipes.engines.native.train import NativeTrainEngine

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, dims.vocab_size, (4, 48), generator=g)  # [B, T]
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": torch.ones(4, 16, dtype=torch.long)}

    def loss(logp, _ent, m):
        mask = m["response_mask"].to(logp.dtype)
        return -(logp * mask).sum() / mask.sum(), {}

    eng = NativeTrainEngine(dims, layout=(1, 1), device=dev, dtype="bf16", lr=1e-3, seed=0, **kw)
    logp = eng.log_probs(mb)[0].float().cpu()
    m = eng.train_micro_batches([mb], loss)
    return logp, m["actor/grad_norm"], m["actor/skipped_step"]


def test_grouped_experts_equal_the_loop_in_bf16(accel_group):
    """MoE experts as grouped GEMMs (bf16: CUTLASS's grouped kernel on sm90 / sm100, ATen's loop below)
    against the loop over experts, within bf16 rounding."""
    from rlrecipes.models import SMOKE

    (lp_g, n_g, s_g), (lp_l, n_l, s_l) = (_two_steps(SMOKE["qwen3_moe"], accel_group, moe_grouped_mm=g)
                                          for g in (True, False))
    assert s_g == s_l == 0.0
    assert float((lp_g - lp_l).abs().max()) < 0.05
    assert abs(n_g - n_l) <= 0.02 * n_l, (n_g, n_l)


def test_inductor_compiled_layers_equal_eager(accel_group):
    """``compile_layers=True`` (inductor: Triton kernels on CUDA) on a 1-layer model, bf16 under FSDP2:
    eager's log-probs and gradient norm within bf16 rounding (the CPU tests compile with aot_eager)."""
    from rlrecipes.models import SMOKE

    dims = dataclasses.replace(SMOKE["qwen2"], num_layers=1)
    (lp_c, n_c, s_c), (lp_e, n_e, s_e) = (_two_steps(dims, accel_group, compile_layers=c) for c in (True, False))
    assert s_c == s_e == 0.0
    assert float((lp_c - lp_e).abs().max()) < 0.05
    assert abs(n_c - n_e) <= 0.02 * n_e, (n_c, n_e)
