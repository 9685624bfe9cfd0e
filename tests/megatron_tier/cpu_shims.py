"""Test-only shims that let megatron-core's local modules run a forward pass on CPU.

megatron-core computes on CUDA: a few places name the CUDA device outright even with
``use_cpu_initialization``. For the megatron tier (no GPU) three are redirected to the host, nothing
else changes, so the numbers are megatron's own modules' numbers:

* ``torch.cuda.current_device()`` -> ``"cpu"`` (MLA's RoPE tables, sequence-parallel gather buffers;
  ``rotary_pos_embedding.py`` and ``tensor_parallel/mappings.py`` create tensors on it);
* the model-parallel RNG tracker's ``fork()`` -> no-op (it swaps CUDA RNG states around dropout;
  the engine runs with dropout 0);
* the default causal mask (``transformer/utils.get_default_causal_mask`` allocates on "cuda") -> the
  same mask on the host.
"""
from __future__ import annotations

import contextlib
import functools

import torch


@functools.lru_cache(maxsize=None)
def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)  # True = masked, as megatron's


@contextlib.contextmanager
def megatron_on_cpu():
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    saved = (torch.cuda.current_device, mrandom.CudaRNGStatesTracker.fork, fused_softmax.get_default_causal_mask)
    torch.cuda.current_device = lambda: "cpu"
    mrandom.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    fused_softmax.get_default_causal_mask = _causal_mask
    try:
        yield
    finally:
        torch.cuda.current_device, mrandom.CudaRNGStatesTracker.fork, fused_softmax.get_default_causal_mask = saved


def engine_pieces(model, dims, ranks, pad_token_id: int = 0):
    """A ``MegatronTrainEngine`` holding ``model`` without its constructor (which refuses the CPU):
    its row layout (``_device_batch``) and log-prob code (``_logprobs``) run as in the engine."""
    from rlrecipes.engines.megatron.train import MegatronTrainEngine

    eng = MegatronTrainEngine.__new__(MegatronTrainEngine)
    eng.device, eng.dims, eng.ranks, eng.pad_token_id = torch.device("cpu"), dims, ranks, pad_token_id
    eng.model, eng.trainable, eng.role, eng.micro_batch_size = model, False, "ref", 4
    return eng


def engine_logprobs(eng, batch, micro_batch_size: int = 4):
    """Log-probs and entropies per sample through the engine's micro-batches, rows and logit gather,
    one micro-batch at a time through ``eng.model`` (what megatron's schedule runs per micro-batch)."""
    from rlrecipes.engines.native import batching

    outs, ents = [None] * len(batch), [None] * len(batch)
    with torch.no_grad():
        for mb in batching.micro_batches(batch, micro_batch_size, eng.pad_token_id):
            d = eng._device_batch(mb)
            logits = eng.model(d["ids"], d["pos"], attention_mask=None)
            logp, ent = eng._logprobs(logits.float(), mb, True)
            batching.rows_to_samples(outs, mb, logp, batch)
            batching.rows_to_samples(ents, mb, ent, batch)
    return outs, ents


def hf_logprobs(hf_model, batch):
    """Reference log-probs and entropies of the responses from the HF model, one sample at a time."""
    outs, ents = [], []
    with torch.no_grad():
        for p, r in zip(batch.prompts, batch.responses):
            ids = torch.cat([p, r])[None]
            logits = hf_model(input_ids=ids).logits.float()[0, p.numel() - 1:-1]  # [R, V]
            lp = torch.log_softmax(logits, -1)
            outs.append(lp.gather(-1, r[:, None])[:, 0])
            ents.append(-(lp.exp() * lp).sum(-1))
    return outs, ents
