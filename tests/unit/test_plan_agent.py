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


def test_without_bubblewrap_plan_refuses_the_python_tool_unless_rlimits_is_chosen(tmp_path, monkeypatch):
    """Fail closed: the seam ($RLRECIPES_BWRAP) points at a bwrap that does not exist."""
    from rlrecipes.agent import ToolSpecError
    from rlrecipes.agent.bwrap import BWRAP_ENV
    from rlrecipes.agent.setup import build_tools

    monkeypatch.setenv(BWRAP_ENV, str(tmp_path / "no-such-bwrap"))
    p = _plan("rollout.multi_turn.tools=[calculator,python]")
    assert not p.ok
    text = format_violations(p)
    for w in ("multi-turn rollout has what it needs", "rollout.multi_turn.sandbox=bwrap", "needs bubblewrap",
              "apt-get install bubblewrap", "set rollout.multi_turn.sandbox=rlimits"):
        assert w in text, text
    assert p.agent["sandbox"].startswith("NONE, the python tool refuses to run")
    recipe = load_recipe("qwen25_7b", smoke=True, overrides=[*ON, "rollout.multi_turn.tools=[calculator,python]"])
    with pytest.raises(ToolSpecError, match="apt-get install bubblewrap"):
        build_tools(recipe)  # a worker's setup fails closed too
    assert _plan("rollout.multi_turn.tools=[calculator]").ok  # no python tool: no sandbox needed
    chosen = _plan("rollout.multi_turn.tools=[calculator,python]", "rollout.multi_turn.sandbox=rlimits")
    assert chosen.ok, format_violations(chosen)
    assert chosen.agent["sandbox"].startswith("rlimits only, as chosen (rollout.multi_turn.sandbox=rlimits)")


def test_the_sandbox_key_takes_only_the_two_modes():
    with pytest.raises(RecipeError, match="rollout.multi_turn.sandbox"):
        load_recipe("qwen25_7b", smoke=True, overrides=[*ON, "rollout.multi_turn.sandbox=auto"])
