"""Long sequences under sequence parallelism: a sample per row, so no ``[rows, 1, T, T]`` attention mask
(and no SDPA bias made of it) is built; the token budget counts the padded rows."""
import torch

from rlrecipes.engines.base import SeqBatch
from rlrecipes.engines.native.batching import packed_micro_batches, token_bins
from rlrecipes.plan.long_context import mask_bytes


def _batch(lengths):
    return SeqBatch([torch.arange(1, 3) for _ in lengths], [torch.arange(3, 3 + n - 2) for n in lengths],
                    per_sample={"advantages": torch.ones(len(lengths))})


def test_padded_bins_count_every_member_at_the_groups_longest():
    lengths = [8, 2, 2, 2, 2]
    assert token_bins(lengths, 16) == [[0, 1, 2, 3, 4]]               # packed: 16 tokens in one row group
    bins = token_bins(lengths, 16, padded=True)
    assert bins == [[0, 1], [2, 3, 4]]                                 # [8, 2 -> 8], then [2, 2, 2]
    for b in bins:
        assert max(lengths[i] for i in b) * len(b) <= 16


def test_one_sample_per_row_needs_no_mask_and_keeps_the_samples():
    lengths = [8, 4, 4, 2, 2]
    batch = _batch(lengths)
    packed = packed_micro_batches(batch, 16, 0, collective=False)
    per_row = packed_micro_batches(batch, 16, 0, collective=False, one_per_row=True)
    # packed: [8 | 4 + 4] and [2 | 2]; a row holding two samples needs the block mask
    assert [mb["input_ids"].shape for mb in packed] == [(2, 8), (2, 2)] and not packed[0]["one_per_row"]
    # a sample per row: [8, 4 -> 8] and [4, 2 -> 4, 2 -> 4]
    assert [mb["input_ids"].shape for mb in per_row] == [(2, 8), (3, 4)]
    assert all(mb["one_per_row"] for mb in per_row)
    for mb in per_row:  # row r holds sample r alone, from column 0, positions 0..n-1
        for r, i in enumerate(mb["sample_index"]):
            n = lengths[i]
            assert mb["position_ids"][r, :n].tolist() == list(range(n))
            assert torch.equal(mb["input_ids"][r, :n], torch.cat([batch.prompts[i], batch.responses[i]]))
    # every response token is a target once, scattered back to its own sample's [b, R] row
    for mb in per_row:
        for j, i in enumerate(mb["sample_index"]):
            mine = mb["unpack_rows"] == j
            assert torch.equal(mb["targets"][mine], batch.responses[i])


def test_the_planned_mask_counts_sdpas_bias_beside_the_boolean():
    # 2 rows of 4,096 tokens packing several samples, bf16: the boolean [2, 1, 4096, 4096] (1 byte) and
    # SDPA's additive bias of the same shape in bf16 (2 bytes)
    assert mask_bytes(2 * 4096, 4096, 2) == 2 * 4096 * 4096 * (1 + 2)
