"""DAPO filter / overlong shaping, the name registry and the typed algorithm: settings."""
import pytest
import torch

from rlrecipes.algos import (
    AlgorithmSettings,
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
from rlrecipes.algos.registry import check_algorithm_name, get_kl_controller


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
    assert get_kl_controller("adaptive").__name__ == "AdaptiveKLController"
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
    "use_kl_in_reward": False, "kl_controller": "fixed", "kl_target": None, "kl_horizon": None,
    "value_clip": 0.2, "ppo_epochs": 1, "skip_old_log_prob": "auto",
    "dynamic_sampling": {"enabled": True, "metric": "score", "max_gen_batches": 3},
    "overlong": {"enabled": True, "buffer_len": 2, "penalty_factor": 1.0},
}


def test_settings_accept_every_yaml_key_and_reject_typos():
    s = AlgorithmSettings.from_dict(YAML_KEYS)
    assert s.clip_ratio_high == 0.28 and s.dynamic_sampling.max_gen_batches == 3 and s.overlong.buffer_len == 2
    with pytest.raises(ValueError, match=r"unknown key algorithm.clip_ratio_hgh.*Did you mean 'clip_ratio_high'"):
        AlgorithmSettings.from_dict({"clip_ratio_hgh": 0.3})
    with pytest.raises(ValueError, match=r"algorithm.overlong.bufer_len.*Did you mean 'buffer_len'"):
        AlgorithmSettings.from_dict({"overlong": {"bufer_len": 3}})
    with pytest.raises(ValueError, match="Did you mean 'low_var_kl'"):
        AlgorithmSettings.from_dict({"kl_estimator": "low_var"})
    with pytest.raises(ValueError, match="kl_target"):
        AlgorithmSettings.from_dict({"kl_controller": "adaptive"})
    with pytest.raises(ValueError, match="dual_clip_c"):
        AlgorithmSettings.from_dict({"dual_clip_c": 1.0})


def test_settings_dapo_flow():
    s = AlgorithmSettings.from_dict(YAML_KEYS)
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0])
    lens = torch.tensor([3, 4, 1, 2])
    mask = (torch.arange(4)[None] < lens[:, None]).float()  # [4, 4]
    shaped = s.shape_scores(scores, lens, max_response_len=4)  # expected len 2, buffer 2
    assert shaped.tolist() == [0.5, 0.0, 1.0, 0.0]
    gid = torch.tensor([0, 0, 1, 1])
    assert s.filter_groups(torch.tensor([1.0, 1.0, 1.0, 0.0]), gid).keep.tolist() == [False, False, True, True]
    assert AlgorithmSettings().filter_groups(scores, gid).keep.all()
    assert s.dynamic_sampler(4).max_gen_batches == 3
    adv, ret, _ = s.compute_advantages(shaped, mask, gid)
    assert torch.allclose(adv, grpo_advantage(shaped, mask, gid)[0])
    assert s.skip_old(mini_batches_per_rollout=1) is True
    assert s.skip_old(mini_batches_per_rollout=2) is False

    logp = torch.full((4, 4), -1.0, requires_grad=True)
    ref = torch.full((4, 4), -1.5)
    ent = torch.full((4, 4), 2.0)
    loss, m = s.actor_loss(logp, None, adv, mask, entropy=ent, ref_logp=ref)
    k3 = kl_penalty(logp.detach(), ref, "k3")[0, 0].item()
    assert loss.item() == pytest.approx(m["actor/pg_loss"].item() - 0.01 * 2.0 + 0.1 * k3, rel=1e-6)
    assert m["actor/kl"].item() == pytest.approx(k3, rel=1e-6)
    with pytest.raises(ValueError, match="use_kl_loss=true needs ref_logp"):
        s.actor_loss(logp, None, adv, mask, entropy=ent)


def test_settings_ppo_flow_gae_kl_in_reward_and_critic():
    s = AlgorithmSettings.from_dict({
        "name": "ppo", "adv_estimator": "gae", "gamma": 1.0, "lam": 1.0, "use_kl_in_reward": True,
        "kl_coef": 0.5, "kl_estimator": "k1", "kl_controller": "adaptive", "kl_target": 0.1, "kl_horizon": 10,
        "value_clip": 0.2, "ppo_epochs": 2,
    })
    assert s.needs_critic and s.skip_old(1) is False
    mask = torch.ones(1, 2)
    values = torch.zeros(1, 2)
    logp, ref = torch.zeros(1, 2), torch.full((1, 2), -0.2)  # k1 = 0.2 per token
    adv, ret, m = s.compute_advantages(torch.tensor([1.0]), mask, torch.tensor([0]), values=values,
                                       logp=logp, ref_logp=ref)
    # token rewards: [-0.1, 1 - 0.1]; gamma = lam = 1, V = 0 -> returns [0.8, 0.9]
    assert torch.allclose(ret, torch.tensor([[0.8, 0.9]]))
    assert m["reward/kl"].item() == pytest.approx(0.2)
    ctrl = s.kl_ctrl()
    assert ctrl.update(m["reward/kl"].item(), 1) == pytest.approx(0.5 * (1 + 0.2 / 10))
    v = torch.tensor([[1.0, 0.85]], requires_grad=True)
    loss, cm = s.critic_loss(v, torch.zeros(1, 2), ret, mask)
    assert cm["critic/vf_clipfrac"].item() == 1.0
    with pytest.raises(ValueError, match="needs critic values"):
        s.compute_advantages(torch.tensor([1.0]), mask, torch.tensor([0]), logp=logp, ref_logp=ref)


def test_grpo_settings_norm_by_std_flag():
    mask = torch.ones(2, 1)
    s = AlgorithmSettings.from_dict({"adv_estimator": "grpo", "norm_adv_by_std": False})
    adv, _, _ = s.compute_advantages(torch.tensor([0.0, 4.0]), mask, torch.tensor([0, 0]))
    assert adv[:, 0].tolist() == [-2.0, 2.0]
