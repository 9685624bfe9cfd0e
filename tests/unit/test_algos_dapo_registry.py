"""DAPO filter / overlong shaping, the name registries and the one algorithm schema (recipe.AlgorithmConfig)."""
import pytest
import torch

from rlrecipes.algos import (
    make_kl_controller,
    DynamicSampler,
    dynamic_sampling_filter,
    get_adv_estimator,
    get_kl_estimator,
    get_loss_agg,
    get_policy_loss,
    grpo_advantage,
    kl_penalty,
    list_names,
    overlong_reward_penalty,
)
from rlrecipes.algos.names import check_algorithm_name
from rlrecipes.algos.registry import get_kl_controller
from rlrecipes.algos.spec import actor_loss_fn, critic_loss_fn, gae_advantages, outcome_advantages
from rlrecipes.recipe import AlgorithmConfig


def test_dynamic_sampling_filter_counts():
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    gid = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    res = dynamic_sampling_filter(metric, gid)
    assert res.keep.tolist() == [False, False, True, True, False, False, True]
    assert (res.kept_groups, res.dropped_groups, res.kept_group_ids) == (2, 2, [1, 3])


def test_dynamic_sampler_fills_then_caps():
    s = DynamicSampler(target_groups=2, max_gen_batches=2)
    s.add(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert not s.full and s.kept_groups == 1 and s.dropped_groups == 1
    s.add(torch.tensor([0.0, 1.0]), torch.tensor([5, 5]))
    assert s.full and s.metrics()["dynamic_sampling/gen_batches"] == 2
    s2 = DynamicSampler(target_groups=5, max_gen_batches=1)
    s2.add(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="max_gen_batches"):
        s2.add(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))


def test_overlong_penalty_hand_computed():
    lens = torch.tensor([10, 15, 17, 20, 25])
    pen = overlong_reward_penalty(lens, max_response_len=20, buffer_len=5, penalty_factor=1.0)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.4, -1.0, -1.0]))
    pen2 = overlong_reward_penalty(lens, max_response_len=20, buffer_len=5, penalty_factor=0.5)
    assert torch.allclose(pen2, pen * 0.5)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_reward_penalty(lens, max_response_len=20, buffer_len=0)


def test_registry_names_aliases_and_errors():
    s, m = torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.ones(4, 2)
    gid = torch.tensor([0, 0, 1, 1])
    a_drgrpo, _ = get_adv_estimator("drgrpo")(s, m, gid)
    a_nostd, _ = get_adv_estimator("grpo_no_std")(s, m, gid)
    a_grpo, _ = get_adv_estimator("grpo")(s, m, gid)
    assert torch.equal(a_drgrpo, a_nostd) and a_nostd[0, 0] == 0.5
    assert torch.allclose(a_grpo, grpo_advantage(s, m, gid)[0])
    lp, ref = torch.tensor([[0.0]]), torch.tensor([[-1.0]])
    assert get_kl_estimator("mse")(lp, ref) == kl_penalty(lp, ref, "k2")
    assert get_kl_estimator("low_var_kl")(lp, ref) == kl_penalty(lp, ref, "k3")
    assert get_loss_agg("seq-mean-token-sum")(torch.ones(2, 2), torch.ones(2, 2)).item() == 2.0
    assert get_policy_loss("ppo_clip").__name__ == "ppo_clip_policy_loss"
    assert type(get_kl_controller("adaptive")(0.1, 1.0, 10)).__name__ == "AdaptiveKLController"
    assert check_algorithm_name("dapo") == "dapo"
    with pytest.raises(ValueError, match=r"unknown adv_estimator 'gea'.*choose one of: drgrpo, gae, grpo, grpo_no_std.*Did you mean 'gae'"):
        get_adv_estimator("gea")
    with pytest.raises(ValueError, match="Did you mean 'ppo_clip'"):
        get_policy_loss("ppo_clp")
    with pytest.raises(ValueError, match="algorithm.name"):
        check_algorithm_name("reinforce")
    assert "k3" in list_names()["algorithm.kl_estimator"]


YAML_KEYS = {
    "name": "dapo", "adv_estimator": "grpo", "norm_adv_by_std": True, "gamma": 1.0, "lam": 0.95,
    "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "dual_clip_c": 3.0, "loss_agg_mode": "token-mean",
    "entropy_coef": 0.01, "use_kl_loss": True, "kl_coef": 0.1, "kl_estimator": "k3",
    "use_kl_in_reward": False, "kl_controller": "fixed", "kl_target": 0.1, "kl_horizon": 100,
    "value_clip": 0.2, "ppo_epochs": 1, "skip_old_log_prob": "auto", "policy_loss": "ppo_clip",
    "dynamic_sampling": {"enabled": True, "metric": "score", "max_gen_batches": 3},
    "overlong": {"enabled": True, "buffer_len": 2, "penalty_factor": 1.0},
}


def test_one_schema_accepts_every_key_and_names_come_from_the_registries():
    s = AlgorithmConfig(**YAML_KEYS)
    assert s.clip_ratio_high == 0.28 and s.dynamic_sampling.max_gen_batches == 3 and s.overlong.buffer_len == 2
    with pytest.raises(ValueError, match="clip_ratio_hgh"):
        AlgorithmConfig(name="grpo", clip_ratio_hgh=0.3)
    with pytest.raises(ValueError, match="bufer_len"):
        AlgorithmConfig(name="grpo", overlong={"bufer_len": 3})
    with pytest.raises(ValueError, match="Did you mean 'low_var_kl'"):
        AlgorithmConfig(name="grpo", kl_estimator="low_var")
    with pytest.raises(ValueError, match="dual_clip_c"):
        AlgorithmConfig(name="grpo", dual_clip_c=1.0)
    with pytest.raises(ValueError, match="ppo_epochs"):
        AlgorithmConfig(name="grpo", ppo_epochs=0)
    # a name registered in algos/ is accepted by the recipe schema with no edit there
    from rlrecipes.algos.kl import KL_ESTIMATORS

    KL_ESTIMATORS.register("test_only_sq")(lambda d: d * d)
    try:
        assert AlgorithmConfig(name="grpo", kl_estimator="test_only_sq").kl_estimator == "test_only_sq"
        assert kl_penalty(torch.tensor([[1.0]]), torch.tensor([[-1.0]]), "test_only_sq").item() == 4.0
    finally:
        KL_ESTIMATORS._table.pop("test_only_sq")


def test_actor_loss_is_pg_minus_entropy_plus_kl():
    cfg = AlgorithmConfig(**YAML_KEYS)
    mask = (torch.arange(4)[None] < torch.tensor([3, 4, 1, 2])[:, None]).float()  # [4, 4]
    gid = torch.tensor([0, 0, 1, 1])
    adv = outcome_advantages(cfg, torch.tensor([0.5, 0.0, 1.0, 0.0]), gid)  # [4]
    assert torch.allclose(adv, grpo_advantage(torch.tensor([0.5, 0.0, 1.0, 0.0]), mask, gid)[0][:, 0])
    logp = torch.full((4, 4), -1.0, requires_grad=True)
    ref = torch.full((4, 4), -1.5)
    ent = torch.full((4, 4), 2.0)
    mb = {"response_mask": mask, "advantages": adv[:, None].expand(4, 4), "ref_log_probs": ref}
    loss, m = actor_loss_fn(cfg, agg={}, kl_coef=0.1, use_ref=True, dp_size=1)(logp, ent, mb)
    k3 = kl_penalty(logp.detach(), ref, "k3")[0, 0].item()
    assert loss.item() == pytest.approx(m["actor/pg_loss"] - 0.01 * 2.0 + 0.1 * k3, rel=1e-6)
    assert m["actor/kl"] == pytest.approx(k3, rel=1e-6)


def test_ppo_gae_with_kl_in_reward_and_adaptive_controller():
    cfg = AlgorithmConfig(name="ppo", adv_estimator="gae", gamma=1.0, lam=1.0, use_kl_in_reward=True,
                          use_kl_loss=False, kl_coef=0.5, kl_estimator="k1", kl_controller="adaptive",
                          kl_target=0.1, kl_horizon=10, value_clip=0.2, ppo_epochs=2)
    adv, ret = gae_advantages(cfg, scores=torch.tensor([1.0]), responses=[torch.zeros(2)],
                              values=[torch.zeros(2)], rollout_log_probs=[torch.zeros(2)],
                              ref_log_probs=[torch.full((2,), -0.2)], kl_coef=0.5)  # k1 = 0.2 per token
    # token rewards: [-0.1, 1 - 0.1]; gamma = lam = 1, V = 0 -> returns [0.8, 0.9]
    assert torch.allclose(ret[0], torch.tensor([0.8, 0.9]))
    ctrl = make_kl_controller(cfg.kl_controller, cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    assert ctrl.update(0.2, 1) == pytest.approx(0.5 * (1 + 0.2 / 10))
    v = torch.tensor([[1.0, 0.85]], requires_grad=True)
    mb = {"response_mask": torch.ones(1, 2), "values": torch.zeros(1, 2), "returns": ret[0][None]}
    _, cm = critic_loss_fn(cfg, agg={})(v, None, mb)
    assert cm["critic/vf_clipfrac"] == 1.0


def test_grpo_norm_by_std_flag():
    cfg = AlgorithmConfig(name="grpo", norm_adv_by_std=False)
    assert outcome_advantages(cfg, torch.tensor([0.0, 4.0]), torch.tensor([0, 0])).tolist() == [-2.0, 2.0]
