"""Inputs and checks the engine tests share (tests/ is on sys.path, as for ``step_cases``)."""
from __future__ import annotations

import torch


def random_prompts(seed: int, lens) -> list[torch.Tensor]:
    """Prompts of the given lengths, random ids in [1, 32)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 32, (n,), generator=g) for n in lens]


def assert_same_rollout(a, b, what: str = "", atol: float = 1e-5) -> None:
    """Two ``RolloutOutput``s: the same tokens, log-probs within ``atol``."""
    assert len(a.responses) == len(b.responses)
    for x, y in zip(a.responses, b.responses):
        assert torch.equal(x, y), (what, x, y)
    for x, y in zip(a.log_probs, b.log_probs):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


def padded_micro_batch(vocab: int, seed: int, B: int = 3, P: int = 6, R: int = 5) -> dict:
    """A padded micro-batch ``[B, P + R]`` with one left-padded and one right-padded row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, P + R), generator=g)  # [B, T]
    am = torch.ones_like(ids)
    am[0, :2] = 0  # left padding
    am[1, P + 3:] = 0  # right padding
    return {"input_ids": ids * am, "attention_mask": am, "response_mask": am[:, P:].clone()}


def engine_pair(dims, a_kw: dict, b_kw: dict, lora=None, **kw):
    """Two native rollout engines that differ only in ``a_kw`` / ``b_kw``, with the same weights: with
    ``lora``, ``a``'s adapters are set to random values (B != 0, so they act) and copied into ``b``."""
    from rlrecipes.engines.native.rollout import NativeRolloutEngine

    a = NativeRolloutEngine(dims, device="cpu", dtype="fp32", seed=0, lora=lora, **a_kw, **kw)
    b = NativeRolloutEngine(dims, device="cpu", dtype="fp32", seed=0, lora=lora, **b_kw, **kw)
    if lora is not None:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in a.model.named_parameters():
                if ".lora_" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        b.load_shards(a.local_shards().items())
    return a, b
