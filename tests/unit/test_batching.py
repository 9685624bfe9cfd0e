"""Moving a train stage's rows: the layout + byte buffer that shares them with model-parallel peers."""
from __future__ import annotations

import torch

from rlrecipes.workflow.batching import _flatten, _unflatten


def test_share_rows_layout_round_trips_every_column_kind():
    data = {"rows": [3, 1], "ids": [torch.arange(3), torch.arange(1)], "mask": [torch.tensor([True]), torch.tensor([False, True])],
            "adv": torch.tensor([0.5, -1.0]), "bf": torch.tensor([1.5, 2.5], dtype=torch.bfloat16), "none": [],
            "scalar": torch.tensor(7), "per_row": [torch.tensor(0.5), torch.tensor(1.5)]}
    layout, parts = _flatten(data)
    assert all(nbytes % 8 == 0 for *_, nbytes in layout)          # every column starts aligned
    out = _unflatten(layout, torch.cat(parts))
    assert out["rows"] == [3, 1] and out["none"] == []
    for k in ("adv", "bf", "scalar"):
        assert torch.equal(out[k], data[k]) and out[k].dtype == data[k].dtype
    for k in ("ids", "mask", "per_row"):
        assert [t.tolist() for t in out[k]] == [t.tolist() for t in data[k]]
        assert [t.dtype for t in out[k]] == [t.dtype for t in data[k]]
