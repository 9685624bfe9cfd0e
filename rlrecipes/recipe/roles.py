"""Which models and passes a recipe builds, and each role's parallel layout: the rules ``plan``, its
memory model and the workers all call, so ``plan`` never shows a role that does not run (nor hides
one that does), and what it checks is the layout the engines and the resharder build from."""
from __future__ import annotations

from dataclasses import dataclass

from ..algos import mini_batches_per_rollout, resolve_skip_old_log_prob
from ..algos.spec import get_algorithm
from ..core.parallel import ParallelLayout
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


def role_layout(recipe: Recipe, role: str, world: int) -> ParallelLayout:
    """The one place a recipe's layout sections become a :class:`~rlrecipes.core.parallel.ParallelLayout`:
    ``role``'s sizes over the ``world`` devices of its group (DP inferred from them). ``ref`` and
    ``critic`` with ``layout: null`` run on the actor's layout (their problems name ``actor.layout``);
    the rollout has no sequence parallelism and no layer split."""
    if role == "rollout":
        ro = recipe.rollout.layout
        return ParallelLayout(role=role, tp=ro.tp, pp=ro.pp, ep=ro.ep, world=world, key="rollout.layout")
    own = recipe.actor.layout if role == "actor" else getattr(recipe, role).layout
    lay, key = (own, f"{role}.layout") if own is not None else (recipe.actor.layout, "actor.layout")
    return ParallelLayout(role=role, tp=lay.tp, pp=lay.pp, ep=lay.ep, world=world, pp_layers=lay.pp_layers,
                          sp=lay.sp, key=key)
