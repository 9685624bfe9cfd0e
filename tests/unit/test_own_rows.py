"""OwnRows: a colocated worker's own rollout rows, as reward, advantage and forward stages read them."""
from __future__ import annotations

import pytest
import torch

from rlrecipes.workflow.own_rows import OwnRows


def _round(rows, base):
    return {"response_ids": [torch.arange(k + 1) + base for k in range(len(rows))],
            "prompt_index": torch.tensor(rows) * 10, "policy_version": torch.full((len(rows),), 3)}


def test_rounds_are_scored_once_and_selected_in_generation_order():
    own = OwnRows()
    own.add([4, 5, 6, 7], _round([4, 5, 6, 7], 0))
    b = own.unscored(["response_ids", "prompt_index"])
    assert b.rows == [4, 5, 6, 7] and b["prompt_index"].tolist() == [40, 50, 60, 70]
    assert [t.numel() for t in b["response_ids"]] == [1, 2, 3, 4]
    own.add_scores(torch.tensor([1.0, 0.0, 0.5, 0.5]))
    own.add([12, 13], _round([12, 13], 100))                     # a second (DAPO) round
    b = own.unscored(["response_ids", "policy_version"])
    assert b.rows == [12, 13] and b["policy_version"].tolist() == [3, 3]
    assert b["response_ids"][1].tolist() == [100, 101]
    own.add_scores(torch.tensor([0.25, 0.75]))
    d = own.select(["scores", "prompt_index", "response_ids"])
    assert d["rows"] == [4, 5, 6, 7, 12, 13]
    assert d["scores"].tolist() == [1.0, 0.0, 0.5, 0.5, 0.25, 0.75]
    assert d["prompt_index"].tolist() == [40, 50, 60, 70, 120, 130]
    # dynamic sampling dropped the group of rows 6, 7: both kinds of column follow the rows
    d = own.select(["scores", "response_ids"], live={4, 5, 12, 13})
    assert d["rows"] == [4, 5, 12, 13] and d["scores"].tolist() == [1.0, 0.0, 0.25, 0.75]
    assert [t.tolist() for t in d["response_ids"]] == [[0], [0, 1], [100], [100, 101]]


def test_scores_are_a_column_only_when_every_row_is_scored():
    own = OwnRows()
    own.add([0, 1], _round([0, 1], 0))
    own.unscored(["response_ids"])
    own.add_scores(torch.tensor([1.0, 2.0]))
    own.add([2, 3], _round([2, 3], 0))                           # generated, not scored yet
    with pytest.raises(KeyError):                               # scores of unscored rows are not made up
        own.select(["scores"])


def test_a_rollout_tp_peer_holds_no_rows():
    own = OwnRows()
    assert len(own.unscored(["response_ids", "policy_version"])) == 0
    d = own.select(["scores", "prompt_ids"])
    assert d["rows"] == [] and len(d["scores"]) == 0 and d["prompt_ids"] == []


def test_the_last_scored_round_and_the_raw_reward_for_dynamic_sampling():
    own = OwnRows()
    own.add([0, 1], _round([0, 1], 0))
    own.unscored(["response_ids"])
    own.add_scores(torch.tensor([1.0, 0.5]), acc=torch.tensor([1.0, 1.0]))
    rows, cols = own.last_round(["acc"])
    assert rows == [0, 1] and cols["acc"].tolist() == [1.0, 1.0]
    own.add([8, 9], _round([8, 9], 0))                           # the next (DAPO) round
    own.unscored(["response_ids"])
    own.add_scores(torch.tensor([0.0, 0.25]), acc=torch.tensor([0.0, 1.0]))
    rows, cols = own.last_round(["scores", "response_ids"])
    assert rows == [8, 9] and cols["scores"].tolist() == [0.0, 0.25]  # this round only: the filter sees new groups
    assert len(cols["response_ids"]) == 2                       # generated columns of the same round
    d = own.select(["scores", "acc"])
    assert d["acc"].tolist() == [1.0, 1.0, 0.0, 1.0] and d["scores"].tolist() == [1.0, 0.5, 0.0, 0.25]



def test_publish_puts_the_live_rows_in_one_write_for_a_claim_of_rebalanced_rows():
    from rlrecipes.core.dock import TransferDock
    from rlrecipes.core.tensor_cache import TensorCache

    dock, cache = TransferDock.local(), TensorCache("cpu", rank=1)
    rows = dock.reset(0, groups=(2, 2))
    own = OwnRows()
    own.add(rows, {**_round(rows, 0), "prompt_ids": [torch.arange(2)] * 4})
    own.unscored(["response_ids"])
    own.add_scores(torch.tensor([1.0, 0.0, 0.5, 0.5]), acc=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    cache.put("advantages", [0, 1], torch.tensor([0.7, -0.7]))
    cache.put("ref_log_probs", [0, 1], [torch.zeros(1), torch.zeros(2)])
    dock.drop_rows([2, 3])                                        # dynamic sampling dropped group 1
    assert dock.stats()["warehouses"][0]["bytes"] == 0            # nothing written while the step is local
    own.publish(dock, cache, rank=1, live={0, 1})
    assert own.published
    b = dock.get("update", ["prompt_ids", "response_ids", "advantages", "scores", "ref_log_probs"], None, timeout=1)
    assert b.rows == [0, 1] and b["advantages"].tolist() == pytest.approx([0.7, -0.7])
    assert b["scores"].tolist() == [1.0, 0.0] and b.holders["ref_log_probs"] == [1, 1]
    assert [t.tolist() for t in b["response_ids"]] == [[0], [0, 1]]
    own.publish(dock, cache, rank=1, live={0, 1})                 # once per step
