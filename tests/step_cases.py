"""Whole RL steps on one worker, stage by stage, with the real workflow (``rlrecipes.workflow.local``):
the cases the GPU stage tests (``tests/gpu``) run on an accelerator and the device-strict tests
(``tests/e2e/test_device_strict.py``) run on a simulated one. Each case is a smoke recipe plus the
overrides that select its path; every case runs rollout with the native sampler, ref (or the LoRA
base), update and reshard, and the ones that need it add the critic and the agent loop."""
from __future__ import annotations

from pathlib import Path

#: name -> (recipe, overrides, stages that must be among the step's stages)
CASES = {
    "grpo_dense": ("qwen25_7b", [], {"rollout", "ref", "update", "reshard"}),
    "dapo_moe": ("qwen3_moe_30b", ["actor.layout.tp=1", "actor.layout.ep=1"], {"rollout", "update", "reshard"}),
    "ppo_critic": ("qwen25_7b", ["algorithm.name=ppo", "algorithm.adv_estimator=gae", "algorithm.lam=0.95"],
                   {"rollout", "ref", "values", "update", "reshard"}),
    "lora": ("qwen25_7b", ["actor.lora.rank=8"], {"rollout", "ref", "update", "reshard"}),
    "multi_turn": ("qwen25_7b", ["rollout.multi_turn.enabled=true", "data.synthetic=add"],
                   {"rollout", "ref", "update", "reshard"}),
}

COMMON = ["trainer.export_hf=false", "trainer.checkpoint_interval=0", "resources.devices_per_node=1"]


def overrides(name: str, device_type: str) -> list[str]:
    recipe, extra, _ = CASES[name]
    dtype = ["model.dtype=fp32"] if device_type == "cuda-simulated" else []
    kind = "cuda" if device_type == "cuda-simulated" else device_type
    return [*COMMON, f"resources.device={kind}", *dtype, *extra]


def run_case(name: str, device_type: str, run_dir: Path, steps: int = 1):
    """Run case ``name`` for ``steps`` steps on ``device_type`` (``cuda``, ``npu``, or ``cuda-simulated``
    inside ``device_strict.simulate()``); returns the progress (metrics rows, stages entered)."""
    from rlrecipes.workflow.local import run_local

    recipe = CASES[name][0]
    return run_local(recipe, overrides(name, device_type), steps, run_dir)


def stages_timed(row: dict) -> set[str]:
    """The stages a metrics row has seconds for."""
    return {k.split("/", 1)[1] for k in row if k.startswith("timing_s/") and k != "timing_s/step"}


def check_step(name: str, progress) -> None:
    """Every stage of the case's step ran and was timed, and the update was applied."""
    stages = set(progress.setup["stages"])
    assert CASES[name][2] <= stages | {"reshard"}, (CASES[name][2], stages)
    assert len(progress.rows) >= 1, progress.rows
    row = progress.rows[-1]
    missing = (set(progress.setup["timed"]) | {"reshard"}) - stages_timed(row)
    assert not missing, f"stages without seconds in the metrics row: {sorted(missing)} (row: {sorted(row)})"
    assert row["actor/skipped_step"] == 0.0
