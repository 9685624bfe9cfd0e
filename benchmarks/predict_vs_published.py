"""plan's step-time model against published RL runs: one JSON line per point.

Each point is a publication's own run, set up as a recipe (the nearest bundled recipe plus the
publication's model, hardware, node count, layouts, batch and lengths), planned with
``build_plan`` and predicted with ``plan.steptime.predict``: the same factors for every point. A line
holds ``point``, ``published`` and ``predicted`` in the published unit (TPS per card, or seconds per
step), their ratio, the unit, the stage seconds, and what had to be assumed. The last line is the
summary: every point's ratio, how many are within +-35 %, and the factors used.

MindSpeed-RL computes TPS as (prompt + response tokens) x batch / actor NPUs / step seconds
(``compute_tps``); an A3 NPU is one die, and its GRPO docs say an A3 card's figure is the logged one
x 2. Its A3 tables hold the logged figure, so they are read per die here (a card is twice it: the
baselines pin the card figure). For the runs whose config leaves ``log_max_throughput`` at its
default (true at those commits) the tokens are the *maximum* prompt and response lengths, not the
means (``tokens: max``); the DAPO trainer always uses the means.

Usage: ``python benchmarks/predict_vs_published.py [--points name,...]``. Test-free; no process starts.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

QWEN3_8B = ("model.preset=null", "model.path=null", "model.family=qwen2",
            # Qwen3-8B's published config.json as planner dimensions (the qwen2 family: the same matmuls;
            # Qwen3's q/k norms add no FLOPs worth counting; Qwen2's q/k/v biases, kept, add 0.01 %)
            'model.smoke={"vocab_size": 151936, "hidden_size": 4096, "num_layers": 36, "num_heads": 32, '
            '"num_kv_heads": 8, "head_dim": 128, "intermediate_size": 12288, "max_position_embeddings": 40960}')
MSRL = "MindSpeed-RL docs/zh/algorithms"
MSRL_UNIT = "TPS per die (MindSpeed-RL's logged e2e_tps: tokens / actor NPUs / s, an A3 NPU is a die; a card is 2x)"


@dataclass
class Point:
    name: str
    recipe: str
    nodes: int
    devices_per_node: int
    overrides: tuple
    published: float
    unit: str
    source: str
    tokens: str = "mean"
    """How the publication counts tokens: ``mean`` lengths, or ``max`` (MindSpeed-RL log_max_throughput)."""
    assumed: list = field(default_factory=list)
    stages: dict = field(default_factory=dict)
    """Published seconds per stage, where the publication breaks the step down."""


POINTS = [
    Point("msrl_grpo_qwen25_7b_a3", "qwen25_7b", 1, 16, (
        "trainer.global_batch=32", "trainer.n_samples_per_prompt=8", "trainer.mini_batch=32",
        "trainer.micro_batch=4", "trainer.max_tokens_per_micro_batch=null", "actor.recompute=false",
        "data.max_prompt_length=2048", "rollout.sampling.max_new_tokens=2048", "rollout.inference.graph_mode=false",
        "rollout.inference.max_num_seqs=1024", "data.expected_prompt_tokens=100", "rollout.expected_response_tokens=650"),
        220, MSRL_UNIT, f"{MSRL}/grpo.md (commit 63fefd0), configs/grpo_qwen25_7b_A3.yaml: 16 dies, 32 x 8, "
                        "2048 / 2048, actor TP2 PP2, vLLM TP1 eager",
        assumed=["mean prompt 100 tokens (deepscaler; not published)",
                 "mean response 650 tokens (read off the published response-length curve, 450-900)"]),
    Point("msrl_grpo_qwen3_8b_a3", "qwen25_7b", 1, 16, QWEN3_8B + (
        "trainer.global_batch=32", "trainer.n_samples_per_prompt=8", "trainer.mini_batch=32", "trainer.micro_batch=1",
        "trainer.max_tokens_per_micro_batch=null", "actor.recompute=false", "data.max_prompt_length=2048",
        "rollout.sampling.max_new_tokens=8192", "rollout.inference.graph_mode=false",
        "data.expected_prompt_tokens=100"),
        252, MSRL_UNIT, f"{MSRL}/grpo.md (commit 17c602e), configs/grpo_qwen3_8b_A3.yaml: 16 dies, 32 x 8, 2048 / 8192",
        tokens="max", assumed=["mean prompt 100 tokens", "mean response: 0.5 x 8192 (not published)",
                               "eager vLLM, as the 7B config (graph mode not stated)",
                               "TPS on maximum lengths (log_max_throughput left at its default)"]),
    Point("msrl_grpo_deepseek_r1_a3", "deepseek_r1_671b", 24, 16, (
        "trainer.global_batch=384", "trainer.n_samples_per_prompt=32", "trainer.mini_batch=384",
        "actor.layout.tp=4", "actor.layout.pp=6", "actor.layout.ep=16", "actor.layout.pp_layers=[10,10,10,10,10,11]",
        "rollout.layout.tp=2", "rollout.layout.ep=64", "rollout.inference.max_num_seqs=64",
        "data.max_prompt_length=1024", "rollout.sampling.max_new_tokens=2048", "trainer.max_tokens_per_micro_batch=4096",
        "data.expected_prompt_tokens=78", "rollout.expected_response_tokens=900"),
        210, MSRL_UNIT, f"{MSRL}/grpo.md (commit de08cc4), configs/grpo_deepseek_r1_671b_A3.yaml: 384 dies, 384 x 32, "
                        "1024 / 2048, actor TP4 PP6 EP16, vLLM TP2 EP64 torchair graph",
        tokens="max", assumed=["pp_layers 10,10,10,10,10,11 (61 layers over PP6; the split is not published)",
                               "mean prompt 78 (cann-recipes-train's deepscaler figure)",
                               "mean response 900 (read off the published curve, 515-1220)",
                               "TPS on maximum lengths (log_max_throughput left at its default)"]),
    Point("msrl_dapo_qwen25_32b_a3", "qwen25_7b", 4, 16, (
        "model.preset=qwen2.5-32b", "algorithm.name=dapo", "trainer.global_batch=256", "trainer.n_samples_per_prompt=16",
        "trainer.mini_batch=32", "trainer.micro_batch=1", "trainer.max_tokens_per_micro_batch=32768",
        "actor.recompute=false", "actor.layout.tp=8", "actor.layout.pp=2", "actor.layout.sp=2", "rollout.layout.tp=4",
        "data.max_prompt_length=2048", "rollout.sampling.max_new_tokens=30720", "data.expected_prompt_tokens=150"),
        108, MSRL_UNIT, f"{MSRL}/dapo.md (commit facb689, dynamic sampling "
        "off), configs/dapo_qwen25_32b_A3_32k.yaml: 64 dies, 256 x 16, 2048 / 30720, actor TP8 PP2 CP2, vLLM TP4",
        assumed=["mean prompt 150 (DAPO-Math-17k; not published)", "mean response: 0.5 x 30720 (not published)",
                 "CP2 as actor.layout.sp=2", "per die, as MindSpeed-RL logs it (dapo.md does not say)"]),
    Point("msrl_grpo_qwen25_32b_a2", "qwen25_7b", 2, 8, (
        "resources.hardware=atlas-a2", "resources.dies_per_card=1", "resources.device_memory_gb=64",
        "model.preset=qwen2.5-32b", "trainer.global_batch=64", "trainer.n_samples_per_prompt=16",
        "trainer.mini_batch=64", "trainer.micro_batch=2", "trainer.max_tokens_per_micro_batch=8192",
        "actor.recompute=false", "actor.layout.tp=8", "actor.layout.pp=1", "rollout.layout.tp=2",
        "rollout.inference.graph_mode=false", "data.max_prompt_length=1024", "rollout.sampling.max_new_tokens=1024",
        "data.expected_prompt_tokens=100"),
        100, "TPS per A2 NPU (one NPU per card)", f"{MSRL}/grpo.md (commit 63fefd0): 16 A2 NPUs, 64 x 16, 1024 / 1024, "
                                                 "actor TP8, vLLM TP2 eager",
        assumed=["mean prompt 100", "mean response: 0.5 x 1024 (not published)"]),
    Point("crt_grpo_deepseek_r1_a3", "deepseek_r1_671b", 16, 16, (
        "data.expected_prompt_tokens=78", "rollout.expected_response_tokens=1577"),
        123.16, "TPS per A3 card", "cann-recipes-train docs/llm_rl/deepseek_rl_train_optimization.md 1.4.1: 128 cards, "
        "512 x 16, 1024 / 3072, actor TP4 PP8 EP8, vLLM TP2 EP128; mean prompt 77.8, response 1576.6",
        stages={"rollout": 373.65, "ref": 144.5, "update": 319.3, "reshard": 11.5, "step": 859.68}),
    Point("verl_deepseek_671b_h20", "deepseek_r1_671b", 12, 8, (
        "resources.hardware=h20", "resources.device=cuda", "resources.dies_per_card=1", "resources.device_memory_gb=96",
        "trainer.global_batch=96", "trainer.n_samples_per_prompt=8", "trainer.mini_batch=32",
        "actor.layout.tp=8", "actor.layout.pp=12", "actor.layout.ep=8",
        "actor.layout.pp_layers=[5,5,5,5,5,5,5,5,5,5,5,6]", "rollout.layout.tp=32", "rollout.layout.ep=1",
        "rollout.inference.graph_mode=false", "data.max_prompt_length=2048", "rollout.sampling.max_new_tokens=9632",
        "data.expected_prompt_tokens=150", "rollout.expected_response_tokens=1960"),
        1700, "seconds per step", "verl docs/perf/dpsk.md (commit e2e4c35) and run_deepseek671b_math_megatron_96gb.sh: "
        "96 H20, 96 x 8 (mini-batch 32), 2048 / 9632, actor TP8 PP12 EP8, vLLM TP32 eager; mean response 1960, "
        "rollout 1050 s", assumed=["mean prompt 150 (DAPO-Math-17k; not published)",
                                   "pp_layers 5 x 11 + 6 (61 layers over PP12; not published)"],
        stages={"rollout": 1050, "step": 1700}),
    Point("mm_grpo_qwen25_vl_7b_a2", "qwen25_vl_7b", 1, 16, ("data.expected_prompt_tokens=200",),
        142.42, "TPS per A2 NPU (one NPU per card)", "MindSpeed-MM verl_plugin/README.md performance table (commit "
        "57069cd): Atlas 200T A2 Box16, 512 x 5, 1024 / 2048, geo3k; launch script train_qwen2_5_vl_7b_grpo_full.sh: "
        "rollout TP4 graph mode, actor and ref Ulysses SP4, 16 prompts per update, micro-batch 2, recompute "
        "(the recipe's own settings)",
        assumed=["16 NPUs (the table's Box16; the launch script defaults to 8)",
                 "mean prompt 200 tokens with its image (geometry3k's small diagrams, about 100 image tokens at "
                 "28x28 pixels per token, and the question; not published)",
                 "mean response: 0.5 x 2048 (not published)"]),
]


def predict_point(p: Point) -> dict:
    from rlrecipes.plan import build_plan
    from rlrecipes.plan.steptime import predict
    from rlrecipes.recipe import load_recipe

    r = load_recipe(p.recipe, overrides=list(p.overrides))
    plan = build_plan(r, p.nodes, p.devices_per_node, keep_batch=True)
    out = {"point": p.name, "published": p.published, "unit": p.unit}
    if any(role.dp is None for role in plan.roles.values()):
        return {**out, "predicted": None, "error": "; ".join(map(str, plan.violations))}
    pred = predict(r, plan)
    samples = plan.global_batch * plan.n_samples
    if p.unit == "seconds per step":
        value = pred.step_s
    else:
        tokens = samples * (r.data.max_prompt_length + r.rollout.sampling.max_new_tokens) if p.tokens == "max" \
            else pred.tokens
        per = plan.world if p.unit.startswith("TPS per die") else pred.cards
        value = tokens / pred.step_s / per
    out.update(predicted=round(value, 2), ratio=round(value / p.published, 3), within_35=abs(value / p.published - 1) <= 0.35,
               tokens=p.tokens, hardware=pred.hardware, cards=pred.cards, step_s=round(pred.step_s, 1),
               stages_s={s.name: round(s.seconds, 2) for s in pred.stages},
               bounds={s.name: s.bound for s in pred.stages})
    if p.stages:
        out["published_stages_s"] = p.stages
    if plan.violations:  # predicted anyway: the publication ran it (our rules may be stricter)
        out["plan_violations"] = [str(v) for v in plan.violations]
    out.update(source=p.source, assumed=p.assumed + pred.assumptions)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default="", help="comma-separated point names (default: all)")
    a = ap.parse_args()
    chosen = [p for p in POINTS if not a.points or p.name in a.points.split(",")]
    lines = [predict_point(p) for p in chosen]
    for line in lines:
        print(json.dumps(line), flush=True)
    from rlrecipes.plan.steptime import load_factors

    ok = [ln for ln in lines if ln.get("within_35")]
    print(json.dumps({"point": "summary", "within_35": f"{len(ok)} of {len(lines)}",
                      "ratios": {ln["point"]: ln.get("ratio") for ln in lines},
                      "factors": load_factors().to_json()}))


if __name__ == "__main__":
    main()
