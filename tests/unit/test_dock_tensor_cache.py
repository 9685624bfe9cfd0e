"""TensorCache local operations (no processes); the all-to-all is tested in tests/dist."""
import pytest
import torch

from rlrecipes.core.tensor_cache import CacheMiss, TensorCache


def test_put_get_clear_and_clear_errors():
    c = TensorCache("cpu", rank=1)
    c.put("ids", [3, 5], [torch.arange(4), torch.arange(2)])
    c.put("logp", [3, 5], torch.ones(2, 4))                 # stacked [rows, L]
    assert c.has("ids", [3, 5]) and not c.has("ids", [4])
    assert [t.tolist() for t in c.get("ids", [5, 3])] == [[0, 1], [0, 1, 2, 3]]
    assert c.stacked("logp", [3, 5]).shape == (2, 4)
    assert c.nbytes() == 6 * 8 + 8 * 4
    with pytest.raises(CacheMiss, match=r"rank 1.*'ids'.*\[4\]"):
        c.get("ids", [3, 4])
    with pytest.raises(ValueError, match="3 tensors for 2 rows"):
        c.put("x", [1, 2], [torch.ones(1)] * 3)
    with pytest.raises(TypeError, match="complex"):
        c.put("x", [1], [torch.ones(1, dtype=torch.complex64)])
    c.clear(step=2)
    assert c.step == 2 and c.rows("ids") == [] and c.nbytes() == 0


def test_encode_decode_roundtrip_variable_length_and_dtypes():
    c = TensorCache("cpu")
    rows = [7, 2, 9]
    ids = [torch.arange(n, dtype=torch.int64) for n in (5, 0, 3)]
    bf = [torch.full((2, n), float(n)).to(torch.bfloat16) for n in (1, 2, 3)]
    c.put("ids", rows, ids)
    c.put("bf", rows, bf)
    out = c._decode(c._encode(["ids", "bf"], rows))
    assert list(out) == ["ids", "bf"] and list(out["ids"]) == rows
    for r, a, b in zip(rows, ids, bf):
        assert torch.equal(out["ids"][r], a) and torch.equal(out["bf"][r], b)
        assert out["bf"][r].dtype == torch.bfloat16
