import os

os.environ.setdefault("RLRECIPES_DEVICE", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


import socket  # noqa: E402

import pytest  # noqa: E402


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
