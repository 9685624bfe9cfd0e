"""The worker's setup is typed and built once (rlrecipes/workflow/context.py)."""
import dataclasses

from rlrecipes.workflow.context import Context, Role, WorkerData, WorkerEngines


def test_no_field_of_the_worker_is_typed_any():
    for cls in (Context, WorkerData, WorkerEngines):
        for f in dataclasses.fields(cls):
            assert "Any" not in str(f.type), f"{cls.__name__}.{f.name}: {f.type}"


def test_the_setup_has_no_defaults_to_patch_later():
    """Everything built at setup is a required constructor argument: nothing is filled in afterwards."""
    built = {"data", "engines", "stages", "kl_ctl", "reshard_plan", "resharder", "cache", "docks", "progress", "role"}
    required = {f.name for f in dataclasses.fields(Context)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.init}
    assert built <= required


def test_roles_are_an_enum_that_compares_with_the_stage_declarations():
    from rlrecipes.algos.spec import RUNS_ON

    assert {r.value for r in Role} == {"both", "train", "rollout"}
    assert Role.TRAIN in RUNS_ON["train"] and Role.ROLLOUT not in RUNS_ON["train"]
