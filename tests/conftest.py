import os

os.environ.setdefault("RLRECIPES_DEVICE", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


import socket  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def random_seq_batch():
    """``make(vocab, n=6, seed=0)``: a SeqBatch of random prompts (3-11 tokens) and responses (2-8)
    with a per-sample ``advantages`` column."""
    import torch

    from rlrecipes.engines.base import SeqBatch

    def make(vocab: int, n: int = 6, seed: int = 0) -> SeqBatch:
        g = torch.Generator().manual_seed(seed)
        lens = [(int(torch.randint(3, 12, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g)))
                for _ in range(n)]
        return SeqBatch(prompts=[torch.randint(1, vocab, (p,), generator=g) for p, _ in lens],
                        responses=[torch.randint(1, vocab, (r,), generator=g) for _, r in lens],
                        per_sample={"advantages": torch.randn(n, generator=g)})

    return make


def policy_gradient_loss(logp, _ent, mb):
    """``-sum(logp * advantage) / response tokens``: a loss closure for engine tests."""
    import torch

    m = mb["response_mask"].to(logp.device)
    return -(torch.where(m.bool(), logp * mb["advantages"].to(logp.device), 0.0)).sum() / m.sum().clamp(min=1), {}


@pytest.fixture
def pg_loss():
    return policy_gradient_loss


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo process group in this process (engines that call torch.distributed)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def vl_tokenizer(tmp_path_factory):
    """The smoke tokenizer with Qwen2.5-VL's vision tokens, written here (no hub)."""
    from transformers import AutoTokenizer

    from rlrecipes.data.smoke import build_smoke_tokenizer

    d = tmp_path_factory.mktemp("vl_tok")
    build_smoke_tokenizer(d, vision=True)
    return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
