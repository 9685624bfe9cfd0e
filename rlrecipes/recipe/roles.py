"""Which models and passes a recipe builds: the one rule ``plan``, its memory model and the workers
all call, so ``plan`` never shows a role that does not run (nor hides one that does)."""
from __future__ import annotations

from dataclasses import dataclass

from ..algos import mini_batches_per_rollout, resolve_skip_old_log_prob
from ..algos.spec import get_algorithm
from .schema import Recipe


@dataclass(frozen=True)
class Roles:
    ref: bool
    """A reference model is built: ``ref.enabled`` and a KL term uses it (``use_kl_loss`` or ``use_kl_in_reward``)."""
    critic: bool
    """A value model is built (the algorithm trains a critic: PPO)."""
    old_pass: bool
    """The old-log-prob forward runs (off-policy: more than one optimizer step per rollout batch)."""
    mini_batches: int
    """Optimizer steps per epoch over one rollout batch."""

    def train_roles(self) -> list[str]:
        return ["actor"] + (["ref"] if self.ref else []) + (["critic"] if self.critic else [])


def roles_of(recipe: Recipe, *, strict: bool = True) -> Roles:
    """``strict=False`` (``plan``, which reports a bad batch split as its own violation): a batch that
    does not split into mini-batches, or ``skip_old_log_prob: true`` off-policy, counts as one
    mini-batch with the old pass built, instead of raising."""
    alg, t = recipe.algorithm, recipe.trainer
    try:
        n_mini = mini_batches_per_rollout(t.global_batch, t.mini_batch)
        old_pass = not resolve_skip_old_log_prob(alg.skip_old_log_prob, alg.ppo_epochs, n_mini)
    except ValueError:
        if strict:
            raise
        n_mini, old_pass = 1, True
    return Roles(ref=bool(recipe.ref.enabled and (alg.use_kl_loss or alg.use_kl_in_reward)),
                 critic=get_algorithm(alg.name).needs_critic(alg), old_pass=old_pass, mini_batches=n_mini)
