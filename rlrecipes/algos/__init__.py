"""RL algorithms as pure functions on padded ``[batch, seq]`` tensors with masks.

See docs/algorithms.md for the formulas and the recipe-YAML key each function serves.
"""
from .advantages import ADV_ESTIMATORS, CRITIC_ESTIMATORS, gae_advantage, group_ids_from_size, group_stats, grpo_advantage
from .dapo import DynamicSampler, GroupFilterResult, dynamic_sampling_filter, overlong_reward_penalty
from .kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
    scores_to_token_rewards,
)
from .logprobs import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from .losses import (
    LOSS_AGG,
    POLICY_LOSSES,
    LOSS_AGG_MODES,
    aggregate_loss,
    entropy_bonus,
    kl_loss,
    loss_normalisers,
    ppo_clip_policy_loss,
    value_loss,
)
from .onpolicy import is_on_policy, mini_batches_per_rollout, old_log_prob_or_detached, resolve_skip_old_log_prob
from .registry import (
    TABLES,
    get_adv_estimator,
    get_kl_controller,
    get_kl_estimator,
    get_loss_agg,
    get_policy_loss,
)
from .names import check_algorithm_name, list_names

import types as _types

__all__ = sorted(n for n, v in dict(globals()).items() if not n.startswith("_") and not isinstance(v, _types.ModuleType))
