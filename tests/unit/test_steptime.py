"""plan's step-time model (rlrecipes/plan/steptime.py): what it prints, what it carries in --json,
and that it moves the way the hardware, the layout and the lengths say it must. No timing here:
every number is the model's, computed from the recipe."""
import json
import shutil

import pytest
from typer.testing import CliRunner

from rlrecipes.cli import app
from rlrecipes.hardware import HARDWARE, get_hardware
from rlrecipes.plan import build_plan
from rlrecipes.plan.steptime import RECORDED, load_factors, measured_from_results, predict, RESULTS
from rlrecipes.recipe import RecipeError, load_recipe

runner = CliRunner()
RECIPES = ("qwen25_7b", "qwen3_moe_30b", "deepseek_r1_671b")


def _pred(name, *overrides, nodes=None, smoke=False, **kw):
    r = load_recipe(name, smoke=smoke, overrides=list(overrides))
    plan = build_plan(r, nodes)
    return r, plan, predict(r, plan, **kw)


@pytest.mark.parametrize("name", RECIPES)
def test_plan_json_carries_the_step_time_and_tps_per_card_for_every_recipe(name):
    out = runner.invoke(app, ["plan", name, "--json"])
    assert out.exit_code == 0, out.output
    pred = json.loads(out.output)["predicted"]
    assert pred["step_s"] > 0 and pred["tps_per_card"] > 0
    stages = pred["stages"]
    assert {"rollout", "update", "reshard", "dock"} <= set(stages)
    assert pred["step_s"] == pytest.approx(sum(s["s"] for s in stages.values()), rel=1e-3)  # colocated: in turn
    assert pred["tps_per_card"] == pytest.approx(pred["tokens"] / pred["step_s"] / pred["cards"], rel=1e-3)


def test_deepseek_on_48_nodes_prints_seconds_per_stage_the_step_and_tps_per_card():
    out = runner.invoke(app, ["plan", "deepseek_r1_671b", "--nodes", "48"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "predicted step on atlas-a3" in text and "s per step" in text and "TPS/card" in text
    for stage in ("rollout", "ref", "update", "reshard"):
        assert f"│ {stage}" in out.output
    js = json.loads(runner.invoke(app, ["plan", "deepseek_r1_671b", "--nodes", "48", "--json"]).output)
    assert js["predicted"]["cards"] == 48 * 16 / 2 and "old" not in js["predicted"]["stages"]  # skip_old_log_prob


def test_a_copied_recipe_on_hardware_no_recipe_pins_gets_its_step_from_plan(tmp_path):
    """resources.hardware=h100 on a copy: the row's FLOP/s and bandwidth, not the A3's."""
    assert runner.invoke(app, ["cp", "qwen25_7b", str(tmp_path / "mine")]).exit_code == 0
    args = ["plan", str(tmp_path / "mine"), "--json", "resources.device=cuda",
            "resources.devices_per_node=8", "resources.device_memory_gb=80", "actor.layout.tp=2", "actor.layout.pp=1"]
    h100 = json.loads(runner.invoke(app, args + ["resources.hardware=h100"]).output)["predicted"]
    h200 = json.loads(runner.invoke(app, args + ["resources.hardware=h200"]).output)["predicted"]
    h20 = json.loads(runner.invoke(app, args + ["resources.hardware=h20"]).output)["predicted"]
    assert h100["hardware"] == "h100" and h200["hardware"] == "h200"
    # 8 GPUs are 8 cards (an H100 card is one GPU), not the 4 the copied recipe's dies_per_card=2 gives; it is said
    assert h100["cards"] == 8 and any("resources.dies_per_card=2 is not used" in x for x in h100["assumptions"])
    # same FLOP/s: the compute-bound update is the same; decode reads memory: faster on the H200
    assert h200["stages"]["update"]["s"] == pytest.approx(h100["stages"]["update"]["s"], rel=1e-6)
    assert h200["stages"]["rollout"]["s"] < h100["stages"]["rollout"]["s"]
    # the H20: 4.0 TB/s but 148 TFLOP/s: a slower update, by the FLOP/s ratio where compute bounds it
    assert h20["stages"]["update"]["s"] == pytest.approx(h100["stages"]["update"]["s"] * 989 / 148, rel=0.05)


def test_an_unknown_hardware_names_the_key_and_the_rows():
    with pytest.raises(RecipeError) as e:
        load_recipe("qwen25_7b", overrides=["resources.hardware=h300"])
    assert "resources.hardware='h300'" in str(e.value) and "h200" in str(e.value) and "atlas-a3" in str(e.value)


def test_every_hardware_number_has_its_source():
    numbers = ("bf16_flops", "hbm_bytes_s", "hbm_gb", "intra_node_bytes_s", "inter_node_bytes_s", "host_bytes_s",
               "collective_latency_s")
    assert {"atlas-a2", "atlas-a3", "h100", "h200", "h20", "cpu"} <= set(HARDWARE)
    for hw in HARDWARE.values():
        missing = [n for n in numbers if not hw.sources.get(n)]
        assert not missing, (hw.name, missing)
    a3 = get_hardware("atlas-a3")  # per die: a card is two of them
    assert a3.devices_per_card == 2 and a3.bf16_flops * 2 == pytest.approx(752e12, rel=0.01)


def test_decode_iterations_follow_the_longest_response_and_tokens_the_mean():
    _, _, base = _pred("qwen25_7b")
    _, _, longer = _pred("qwen25_7b", "rollout.sampling.max_new_tokens=4096", "rollout.expected_response_tokens=1024")
    ratio = longer.stages[0].seconds / base.stages[0].seconds
    assert 1.9 < ratio < 2.5  # twice the iterations, each reading a little more KV cache
    assert longer.response_tokens == 1024 and base.response_tokens == 1024  # default: half of max_new_tokens


def test_recompute_adds_a_forward_to_the_update():
    _, _, on = _pred("qwen25_7b", "actor.recompute=true")
    _, _, off = _pred("qwen25_7b", "actor.recompute=false")
    upd = {p.stages[i].name: p.stages[i] for p in (on,) for i in range(len(p.stages))}["update"]
    upd_off = {s.name: s for s in off.stages}["update"]
    assert upd.seconds / upd_off.seconds == pytest.approx(4 / 3, rel=0.05)


def test_an_off_policy_recipe_pays_the_old_pass_and_ppo_its_critic():
    _, _, grpo = _pred("qwen25_7b", "trainer.mini_batch=8", nodes=None)
    assert "old" in [s.name for s in grpo.stages]
    _, _, ppo = _pred("qwen25_7b", "algorithm.name=ppo", "algorithm.adv_estimator=gae", "actor.engine=native",
                      "actor.layout.pp=1", "actor.layout.tp=1")
    names = [s.name for s in ppo.stages]
    assert "values" in names and "critic_update" in names


def test_disaggregated_with_staleness_overlaps_rollout_and_training():
    common = ["resources.placement=disaggregated", "resources.rollout_devices=8", "actor.layout.pp=1",
              "actor.layout.tp=2"]
    _, _, sync = _pred("qwen25_7b", *common, "algorithm.max_staleness=0")
    _, _, over = _pred("qwen25_7b", *common, "algorithm.max_staleness=1")
    train = sum(s.seconds for s in over.stages if s.name != "rollout")
    assert not sync.overlap and sync.step_s == pytest.approx(sum(s.seconds for s in sync.stages), rel=1e-6)
    assert over.overlap and over.step_s == pytest.approx(max(over.stages[0].seconds, train), rel=1e-6)


def test_a_moe_decode_reads_only_the_experts_its_tokens_touch():
    """One row per group touches few of 128 experts; a full batch touches nearly all of them."""
    _, _, one = _pred("qwen3_moe_30b", "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.n_samples_per_prompt=1",
                      "rollout.layout.ep=1", "rollout.layout.tp=1")
    assert "experts touched" in one.stages[0].detail
    touched = int(one.stages[0].detail.split("experts touched ")[1].split("%")[0])
    assert touched < 30


def test_the_factors_follow_the_newest_committed_results(tmp_path):
    """A newer gpu_suite file with a faster megatron: the model's megatron update gets faster by the
    same ratio, with no code change."""
    base = load_factors(RESULTS)
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    newest = max(results.glob("gpu_suite-*.json"))
    data = json.loads(newest.read_text())
    data["started"] = "2099-01-01T00:00:00"
    for line in data["lines"]:
        if line.get("part") == "train" and line.get("engine") == "megatron":
            line["mfu"] = line["mfu"] * 2
    (results / "gpu_suite-faster-20990101.json").write_text(json.dumps(data))
    faster = load_factors(results)
    assert faster.mfu["megatron"].value == pytest.approx(2 * base.mfu["megatron"].value)
    assert "gpu_suite-faster-20990101.json" in faster.mfu["megatron"].source
    r = load_recipe("qwen25_7b")
    plan = build_plan(r)
    slow, fast = predict(r, plan, base), predict(r, plan, faster)
    upd = {s.name: s.seconds for s in slow.stages}["update"], {s.name: s.seconds for s in fast.stages}["update"]
    assert upd[0] / upd[1] == pytest.approx(2, rel=0.1)


def test_the_recorded_factors_are_what_the_newest_results_give():
    """rlrecipes/plan/measured.json (a wheel's copy) must not drift from benchmarks/results/."""
    assert measured_from_results(RESULTS) == json.loads(RECORDED.read_text())


def test_smoke_plans_predict_on_the_cpu_row():
    for name in RECIPES:
        _, plan, pred = _pred(name, smoke=True)
        assert pred.hardware == "cpu" and pred.cards == 2
        assert pred.prompt_tokens == 5 and pred.response_tokens == 6  # smoke.yaml's expected lengths
        assert {s.bound for s in pred.stages if s.name in ("ref", "update")} <= {"host", "link"}


def test_a_results_file_without_an_item_falls_back_to_the_recorded_one_and_a_cpu_suite_is_ignored(tmp_path):
    """A newer accelerator suite that only trained (no decode line) moves the MFU, not the eager
    decode; a suite run on the CPU (device_type cpu) moves nothing; plan never fails for it."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    base = json.loads(max(results.glob("gpu_suite-*.json")).read_text())
    partial = {**base, "started": "2099-01-01T00:00:00",
               "lines": [dict(ln, mfu=0.5) for ln in base["lines"] if ln.get("part") == "train" and ln.get("engine") == "native"]}
    (results / "gpu_suite-partial-20990101.json").write_text(json.dumps(partial))
    cpu_run = {**base, "started": "2099-02-01T00:00:00", "device_type": "cpu",
               "lines": [dict(ln, mfu=0.01) for ln in base["lines"] if ln.get("part") == "train"]}
    (results / "gpu_suite-cpu-20990201.json").write_text(json.dumps(cpu_run))
    f = load_factors(results)
    assert f.mfu["native"].value == 0.5 and "partial" in f.mfu["native"].source
    assert f.mfu["megatron"].value == load_factors(RESULTS).mfu["megatron"].value  # not in the partial file
    assert f.eager_layer_s["accelerator/decode"].value == load_factors(RESULTS).eager_layer_s["accelerator/decode"].value


def _stage(pred, name):
    return {s.name: s for s in pred.stages}[name]


def test_fsdp_gathers_are_counted_once_and_a_distributed_optimizer_syncs_per_optimizer_step():
    """native (fsdp): no extra DP sync on top of its per-micro-batch gathers; megatron: one
    reduce-scatter + all-gather per optimizer step, twice as much with two mini-batches."""
    _, _, native = _pred("qwen25_7b", "actor.engine=native", "actor.layout.pp=1", "actor.layout.tp=2")
    assert "DP gradient sync" not in _stage(native, "update").detail
    _, _, one = _pred("qwen25_7b", "actor.layout.tp=4", "actor.layout.pp=1", "trainer.mini_batch=32")
    _, _, two = _pred("qwen25_7b", "actor.layout.tp=4", "actor.layout.pp=1", "trainer.mini_batch=16")
    sync = [float(_stage(p, "update").detail.split("DP gradient sync ")[1].split(" s")[0]) for p in (one, two)]
    assert sync[1] == pytest.approx(2 * sync[0], rel=0.02)


def test_the_pipeline_drains_at_every_optimizer_step():
    _, _, one = _pred("qwen25_7b", "trainer.mini_batch=32")  # PP2: one flush per step
    _, _, four = _pred("qwen25_7b", "trainer.mini_batch=8")   # four optimizer steps: four flushes
    bubble = [float(_stage(p, "update").detail.split("pipeline bubble x")[1].split(" ")[0]) for p in (one, four)]
    assert bubble[1] > bubble[0] > 1.0


def test_a_backward_moves_the_forwards_tp_traffic_once_more_not_twice():
    """TP traffic of the update = 2 x the ref forward's (3 x with recompute), not 3 x (4 x)."""
    _, _, p = _pred("qwen25_7b", "actor.layout.tp=4", "actor.layout.pp=1", "actor.recompute=false")
    traffic = [float(_stage(p, n).detail.split("TP/EP traffic ")[1].split(" s")[0]) for n in ("ref", "update")]
    assert traffic[1] == pytest.approx(2 * traffic[0], rel=0.02)


def test_a_split_model_on_this_cpu_is_priced_from_its_own_layouts_measurement(tmp_path):
    """qwen3_moe_30b's smoke actor runs TP2 EP2 over gloo: its passes take the layout's own
    measured cost (collectives included, so no modelled collective latency is added), which a
    newer layout_pass_cost file moves; its rollout at DP2 decodes alone and keeps the one-process
    decode cost; with no layout measurement the pass falls back to the one-process cost."""
    _, plan, pred = _pred("qwen3_moe_30b", smoke=True)
    assert plan.roles["actor"].tp == 2 and plan.roles["actor"].ep == 2
    update = _stage(pred, "update")
    assert "TP/EP traffic" not in update.detail and update.bound == "host"
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    newest = json.loads(max(results.glob("layout_pass_cost-cpu-*.json")).read_text())
    slower = {**newest, "started": "2099-01-01T00:00:00",
              "lines": [dict(ln, per_layer_s=ln["per_layer_s"] * 10, fixed_s=1.0) for ln in newest["lines"]]}
    (results / "layout_pass_cost-cpu-20990101.json").write_text(json.dumps(slower))
    f = load_factors.__wrapped__(results)
    recipe = load_recipe("qwen3_moe_30b", smoke=True)
    moved = predict(recipe, plan, f)
    assert _stage(moved, "update").seconds > update.seconds + 1.0  # the fixed second, at least
    assert _stage(moved, "rollout").seconds == pytest.approx(_stage(pred, "rollout").seconds)  # DP2: decodes alone
    for p in results.glob("layout_pass_cost-*.json"):
        p.unlink()
    bare = load_factors.__wrapped__(results)
    bare.eager_layer_s = {k: v for k, v in bare.eager_layer_s.items() if not k.endswith(("/tp2ep2", "/dp2", "/tp2"))}
    fallback = _stage(predict(recipe, plan, bare), "update")
    assert "TP/EP traffic" in fallback.detail  # one-process cost plus the modelled collectives


def test_a_benchmarked_device_finds_its_row_by_its_reported_name():
    from rlrecipes.hardware import hardware_of_device

    assert hardware_of_device("NVIDIA H200", "cuda") == "h200"  # not the H20 row it also contains
    assert hardware_of_device("NVIDIA H20", "cuda") == "h20"
    assert hardware_of_device("NVIDIA H100 80GB HBM3", "cuda") == "h100"
    assert hardware_of_device("Ascend910B3", "npu") == "atlas-a2"
    assert hardware_of_device("Ascend910_9392", "npu") == "atlas-a3"
    assert hardware_of_device("anything", "cpu") == "cpu"
    assert hardware_of_device("NVIDIA A100-SXM4-80GB", "cuda") is None  # no row: no share is claimed


def _flops(pred, stage):
    detail = {s.name: s.detail for s in pred.stages}[stage]
    return float(detail.split(" PFLOP")[0]) * 1e15


def test_a_vision_language_step_pays_the_towers_flops_in_every_pass(monkeypatch):
    import rlrecipes.plan.vision as vision
    from rlrecipes.plan.vision import image_tokens, vision_flops_per_image

    base = ("data.expected_prompt_tokens=600", "rollout.expected_response_tokens=400")
    r, plan, trained = _pred("qwen25_vl_7b", *base, "actor.freeze_vision_tower=false")
    _, _, frozen = _pred("qwen25_vl_7b", *base, "actor.freeze_vision_tower=true")
    dims, samples = r.model.dims(), plan.global_batch * plan.n_samples
    per_image = vision_flops_per_image(dims, r, 600)
    assert 600 < image_tokens(dims, r) and per_image > 0
    assert any("600 image tokens" in a for a in trained.assumptions)
    # the ref pass: one tower forward per sample on each device of the sample's group: the tower is
    # replicated over TP and runs whole images on every SP rank (the recipe's published SP4: four)
    ref = plan.roles["ref"]
    group = ref.tp * ref.sp
    assert group == 4
    with monkeypatch.context() as m:
        m.setattr(vision, "vision_flops_per_image", lambda *a, **k: 0.0)
        _, _, blind = _pred("qwen25_vl_7b", *base, "actor.freeze_vision_tower=false")
    assert _flops(trained, "ref") - _flops(blind, "ref") == pytest.approx(group * samples * per_image, rel=0.02)
    # a trained tower runs backward too (3 forward-equivalents, +1 recomputed), a frozen one forward only
    extra = 2 + (1 if r.actor.recompute else 0)
    assert _flops(trained, "update") - _flops(frozen, "update") == pytest.approx(
        extra * group * samples * per_image, rel=0.02)
    # the image tokens are the mean prompt's: an image is never counted larger than the prompt
    _, _, short = _pred("qwen25_vl_7b", "data.expected_prompt_tokens=50", "rollout.expected_response_tokens=400")
    assert any("50 image tokens" in a for a in short.assumptions)
