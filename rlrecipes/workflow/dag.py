"""The algorithm as a small DAG of stages, declared in Python.

Each stage names the dock columns it reads and writes; ``build_dag`` checks that every input is
produced by an earlier stage (or is a rollout output) and returns the stages in execution order.
Every worker runs its own controller loop over this list (``workflow/worker.py``); a stage's
``run`` method on the worker is looked up by the stage name.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stage:
    name: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    repeat_group: str | None = None
    """Stages sharing a repeat group run again while DAPO's dynamic sampling needs more groups."""
    doc: str = ""


@dataclass
class DAG:
    algorithm: str
    stages: list[Stage] = field(default_factory=list)

    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def __contains__(self, name: str) -> bool:
        return name in self.names()


def build_dag(algorithm: str, *, use_ref: bool, skip_old: bool, dynamic_sampling: bool) -> DAG:
    """Stages of GRPO, DAPO or PPO in execution order."""
    if algorithm not in ("grpo", "dapo", "ppo"):
        raise ValueError(f"unknown algorithm {algorithm!r}; choose grpo, dapo or ppo")
    gen = "sampling" if dynamic_sampling else None
    st = [
        Stage("rollout", (), ("prompt_ids", "response_ids", "prompt_index", "rollout_log_probs"), gen,
              "generate n responses per prompt with the rollout engine"),
        Stage("reward", ("prompt_ids", "response_ids", "prompt_index"), ("scores",), gen,
              "score responses (rule reward, overlong shaping)"),
    ]
    if dynamic_sampling:
        st.append(Stage("dynamic_sampling", ("scores",), (), gen,
                        "drop groups with constant scores; generate more until the batch is full"))
    if use_ref:
        st.append(Stage("ref", ("prompt_ids", "response_ids"), ("ref_log_probs",), None, "reference log-probs"))
    if not skip_old:
        st.append(Stage("old", ("prompt_ids", "response_ids"), ("old_log_probs",), None, "old (behaviour) log-probs"))
    if algorithm == "ppo":
        st.append(Stage("values", ("prompt_ids", "response_ids"), ("values",), None, "critic values"))
        st.append(Stage("advantage", ("scores", "response_ids", "values") + (("ref_log_probs",) if use_ref else ()),
                        ("advantages", "returns"), None, "GAE"))
        st.append(Stage("critic_update", ("prompt_ids", "response_ids", "values", "returns"), (), None, "critic step"))
    else:
        st.append(Stage("advantage", ("scores",), ("advantages",), None, "group-normalised outcome advantage"))
    update_reads = ("prompt_ids", "response_ids", "advantages") + (("ref_log_probs",) if use_ref else ()) + \
        (() if skip_old else ("old_log_probs",))
    st.append(Stage("update", update_reads, (), None, "actor policy-gradient step"))
    st.append(Stage("reshard", (), (), None, "train layout -> rollout layout weights"))
    dag = DAG(algorithm, st)
    _check(dag)
    return dag


def _check(dag: DAG) -> None:
    produced: set[str] = set()
    for s in dag.stages:
        missing = [c for c in s.reads if c not in produced]
        if missing:
            raise ValueError(f"{dag.algorithm} DAG: stage {s.name!r} reads {missing} before any stage writes them")
        produced.update(s.writes)
