"""A whole RL step on a device that is not the host, on CPU (``rlrecipes.device_strict``).

The first whole step on a GPU failed in ``update`` on a cuda:0 / cpu mix that every CPU test had
passed: on CPU the engine's device is the host. Here each case of ``tests/step_cases.py`` runs one
colocated step through the real worker (rollout with the native sampler, ref, advantage, update,
reshard; the critic, LoRA and the agent loop where the case has them) with every engine tensor on a
simulated ``cuda`` device, so any host/device mix raises as on the GPU, naming the op, the line, and
where the device tensor came from."""
import warnings

import pytest

from rlrecipes import device_strict
from step_cases import CASES, check_step, run_case

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_whole_step_keeps_host_and_device_apart(name, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with device_strict.simulate("cuda") as device:
            progress = run_case(name, "cuda-simulated", tmp_path / name)
    assert device.type != "cpu" and progress.setup["device"] == str(device)
    check_step(name, progress)


def test_the_update_stage_mix_the_gpu_found_is_named(tmp_path):
    """The negative control in miniature: a packed-row builder handed a column on the device (as the
    TensorCache hands ``ref_log_probs`` to the update) raises, naming the op, the line and the column's
    origin, as CUDA did; the engine's entry (``packed_micro_batches``) takes the same batch."""
    import torch

    from rlrecipes.engines.base import SeqBatch
    from rlrecipes.engines.native.batching import HOST, pad_rows, packed_micro_batches

    with device_strict.simulate("cuda") as device:
        rows = [torch.randn(3).to(device), torch.randn(2).to(device)]
        with pytest.raises(device_strict.DeviceMixError, match=r"index_put_.*batching\.py.*_fill.*on the device since"):
            pad_rows(rows, 4)
        batch = SeqBatch([torch.tensor([1, 2]), torch.tensor([3])], [torch.tensor([4, 5, 6]), torch.tensor([7, 8])],
                         per_token={"ref_log_probs": rows}, per_sample={"advantages": torch.ones(2).to(device)})
        (mb,) = packed_micro_batches(batch, 64, 0, collective=False, device=device)
        assert {v.device for v in mb.values() if isinstance(v, torch.Tensor)} == {device}
        assert torch.equal(mb["ref_log_probs"].cpu()[0, :3], rows[0].cpu())
        (mb,) = packed_micro_batches(batch, 64, 0, collective=False)
        assert {v.device for v in mb.values() if isinstance(v, torch.Tensor)} == {HOST}
