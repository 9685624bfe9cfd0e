"""The columns a step's rows carry, named once: every column the stages read and write, and the
groups of them the workflow treats alike.

A stage declares its columns by these names (``algos/spec.py``); the workflow moves them by the
groups below (``workflow/stage_io.py``, ``shares.py``, ``own_rows.py``, ``pool_rows.py``). A column
name that is not in :data:`COLUMNS` is refused where a group is built, so a typo fails on import.
"""
from __future__ import annotations

#: every column of a step's rows: name -> what one row holds
COLUMNS = {
    "prompt_ids": "the prompt's token ids (one tensor per row; a group's rows share it)",
    "response_ids": "the response's token ids, [R_i]",
    "response_mask": "multi-turn: 1 on model tokens, 0 on tool observations, [R_i]",
    "prompt_index": "the prompt's index in the dataset",
    "rollout_log_probs": "the rollout engine's log-prob of each response token, [R_i]",
    "policy_version": "the policy version the row was generated under",
    "token_versions": "a pooled rollout: the policy version of each response token, [R_i]",
    "routed_experts": "MoE routing replay: the experts each token was routed to",
    "scores": "the reward after shaping (what the advantage is computed from)",
    "acc": "the raw reward, before shaping",
    "ref_log_probs": "the reference model's log-probs, [R_i]",
    "old_log_probs": "the behaviour policy's log-probs under the train layout, [R_i]",
    "values": "the critic's values, [R_i]",
    "advantages": "the advantage: one number per row (outcome) or [R_i] (GAE)",
    "returns": "GAE's returns, [R_i]",
    "born": "the carry-over dock: the step a carried group was drawn",
    "done": "the carry-over dock: whether a carried sample has ended",
}


def _columns(*names: str) -> tuple[str, ...]:
    unknown = [c for c in names if c not in COLUMNS]
    if unknown:
        raise ValueError(f"columns {unknown} are not in rlrecipes/algos/columns.py COLUMNS")
    return names


#: what the rollout stage generates: the rows' own columns (a colocated stage that reads only these,
#: and columns computed on the same worker, may run on the rows where they were generated;
#: ``response_mask`` is not among them, so a multi-turn update re-balances its rows)
GENERATED = _columns("prompt_ids", "response_ids", "prompt_index", "rollout_log_probs", "policy_version",
                     "routed_experts", "token_versions")
#: what the reward stage writes
REWARD = _columns("scores", "acc")
#: what a forward pass produces; kept in the TensorCache of the worker that computed it, never put
#: in the dock (a claim of those rows fetches it by one all-to-all)
CACHED = _columns("ref_log_probs", "old_log_probs", "values")
#: per-token columns of a train batch besides the response itself
PER_TOKEN = _columns("rollout_log_probs", "ref_log_probs", "old_log_probs", "values", "returns", "response_mask")
#: what a pooled rollout writes per row (``workflow/pool.py``): the generated columns, the version of
#: every response token, and the scores it filtered (or merely graded) the groups by
POOLED_WRITES = _columns("prompt_ids", "response_ids", "prompt_index", "rollout_log_probs", "policy_version",
                         "token_versions", "scores", "acc")
#: a carried row's columns in the carry-over dock (``workflow/pool_rows.py``)
CARRY_COLUMNS = _columns("prompt_ids", "response_ids", "rollout_log_probs", "token_versions", "prompt_index",
                         "born", "done", "scores", "acc")
