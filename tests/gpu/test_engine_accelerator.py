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
