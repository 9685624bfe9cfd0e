"""The native train engine's memory features change memory, not results: activation recomputation
per decoder layer and the optimizer state parked on the host between steps give the same training."""
import torch

from rlrecipes.engines.base import SeqBatch
from rlrecipes.engines.native.train import NativeTrainEngine
from rlrecipes.models import smoke_dims


def _batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = [3, 5, 2, 4]
    return SeqBatch(prompts=[torch.randint(1, vocab, (4,), generator=g) for _ in R],
                    responses=[torch.randint(1, vocab, (r,), generator=g) for r in R])


def _loss(logp, _ent, mb):
    m = mb["response_mask"]
    return -(torch.where(m.bool(), logp, 0.0)).sum() / m.sum().clamp(min=1), {}


class SeparateHost(NativeTrainEngine):
    host_is_device = False  # on CPU host memory is device memory: take the parking path anyway


def _train(one_rank_group, steps=2, **kw):
    eng = SeparateHost(smoke_dims("qwen2"), layout=(1, 1), seed=0, lr=1e-2, micro_batch_size=2, **kw)
    metrics = [eng.train_step(_batch(eng.dims.vocab_size, s), _loss) for s in range(steps)]
    return eng, metrics


def test_recompute_gives_the_same_training(one_rank_group):
    plain, m0 = _train(one_rank_group)
    ckpt, m1 = _train(one_rank_group, recompute=True)
    assert all(layer.gradient_checkpointing for layer in ckpt.model.model.layers)
    assert not any(layer.gradient_checkpointing for layer in plain.model.model.layers)
    for a, b in zip(m0, m1):
        assert abs(a["actor/grad_norm"] - b["actor/grad_norm"]) < 1e-5
    for (n, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)


def test_offloaded_optimizer_state_is_parked_between_steps_and_training_is_unchanged(one_rank_group):
    plain, _ = _train(one_rank_group)
    off, _ = _train(one_rank_group, offload_optimizer=True)
    assert off._opt_parked is not None and off._opt_parked.nbytes > 0
    state = [v for st in off.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    assert state and all(v.untyped_storage().nbytes() == 0 for v in state)  # nothing left on the device
    for p, q in zip(plain.model.parameters(), off.model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    sd = off.state_dict()  # a checkpoint brings the state back first
    assert off._opt_parked is None and sd["optim"]["state"]
