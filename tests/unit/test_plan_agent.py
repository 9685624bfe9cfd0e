"""``plan`` refuses a multi-turn setup that cannot run, naming the key and the fix, before anything starts."""
import pytest

from rlrecipes.plan import build_plan, format_violations
from rlrecipes.recipe import RecipeError, load_recipe

ON = ["rollout.multi_turn.enabled=true", "data.synthetic=add"]


def _plan(*overrides):
    return build_plan(load_recipe("qwen25_7b", smoke=True, overrides=[*ON, *overrides]))


def test_a_sound_setup_passes_and_reports_the_sandbox():
    p = _plan("rollout.multi_turn.tools=[calculator,python]")
    assert p.ok, format_violations(p)
    assert p.agent["tool_format"] == "smoke" and p.agent["tools"] == ["calculator", "python"]
    assert "bubblewrap" in p.agent["sandbox"] or "rlimits" in p.agent["sandbox"]
    assert p.to_json()["agent"]["max_turns"] == 2


@pytest.mark.parametrize("override, words", [
    ("rollout.multi_turn.tools=[calculater]", ["unknown tool 'calculater'", "Did you mean 'calculator'"]),
    ("rollout.multi_turn.tools=[no_such_pkg.tools:lookup]", ["cannot import module 'no_such_pkg.tools'"]),
    ("rollout.multi_turn.tools=[json:no_such_function]", ["no_such_function"]),
    ("rollout.multi_turn.tool_format=qwen", ["tool_format=qwen", "chat template"]),
    ("rollout.multi_turn.max_response_tokens=4", ["max_response_tokens=4", "max_new_tokens=8"]),
    ("algorithm.routing_replay=true", ["routing_replay"]),
])
def test_bad_settings_fail_in_plan_with_the_key_and_the_fix(override, words, tmp_path, monkeypatch):
    if "tool_format=qwen" in override:  # a tokenizer folder without a chat template: qwen cannot render
        from rlrecipes.data.smoke import build_smoke_tokenizer

        override = [override, f"model.tokenizer={build_smoke_tokenizer(tmp_path / 'tok')}"]
    p = _plan(*([override] if isinstance(override, str) else override))
    assert not p.ok
    text = format_violations(p)
    assert "multi-turn rollout has what it needs" in text
    for w in words:
        assert w in text, text


def test_max_turns_below_one_is_a_recipe_error():
    with pytest.raises(RecipeError, match=r"rollout.multi_turn.max_turns.*must be >= 1"):
        load_recipe("qwen25_7b", smoke=True, overrides=[*ON, "rollout.multi_turn.max_turns=0"])


def test_vllm_instances_over_several_ranks_are_refused_native_ones_pass():
    vllm = _plan("rollout.engine=vllm", "rollout.layout.tp=2")
    assert any("rollout.engine=vllm runs multi-turn rollouts on one rank" in v.detail for v in vllm.violations)
    assert build_plan(load_recipe("deepseek_r1_671b", smoke=True, overrides=ON)).ok  # native TP2 EP2
