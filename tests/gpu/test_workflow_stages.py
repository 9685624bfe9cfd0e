"""Every stage of a colocated step on the accelerator, through the real workflow (not a hand-made
batch): rollout with the native sampler, reward, ref (or LoRA's base), advantage, update (and PPO's
critic), reshard, for a dense and an MoE smoke model, LoRA and the multi-turn agent loop. Each case
of ``tests/step_cases.py`` runs one step on one device with the recipe's own dtype (bf16 on a GPU:
FSDP2 mixed precision). The same cases run on CPU on a simulated device in the main suite
(``tests/e2e/test_device_strict.py``). Skipped on hosts without an accelerator (CI)."""
import pytest

from rlrecipes import device as devmod
from step_cases import CASES, check_step, run_case

KIND = devmod.accelerator()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(KIND is None, reason="needs a CUDA or NPU device")]


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_stage_of_a_step_runs_on_the_device(name, tmp_path, monkeypatch):
    monkeypatch.setenv("RLRECIPES_DEVICE", KIND)  # tests/conftest.py pins cpu for the CPU suite
    progress = run_case(name, KIND, tmp_path / name)
    assert progress.setup["device"].startswith(KIND), progress.setup
    check_step(name, progress)
    row = progress.rows[-1]
    assert row["mem/peak_gb"] > 0
