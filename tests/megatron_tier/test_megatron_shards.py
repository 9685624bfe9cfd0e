"""megatron-core tier, several processes over gloo: the TP / PP / EP / expert-TP sharded modules
megatron-core builds on CPU (use_cpu_initialization) have exactly the per-rank names and shapes of
``shard.megatron_shard``; the HF weights load into them; each rank's ``local_shards`` (HF names) are
the slices the resharder's ParamSpecs say it holds; gathering them gives the HF model back exactly
(the export path); the per-rank checkpoint files and the storage-level offload round trip; without PP,
the forward with sequence parallelism (TP2), EP and MLA through the engine's rows and vocab-parallel
log-probs gives the HF model's log-probs (cpu_shims). Skipped where megatron-core is not installed."""
import dataclasses
import os
import socket

import pytest
import torch

pytest.importorskip("megatron.core")

from cpu_shims import engine_logprobs, engine_pieces, hf_logprobs, megatron_on_cpu  # noqa: E402

pytestmark = pytest.mark.megatron

WORLD = 4
CASES = {
    # a vocabulary padded to a multiple of TP, uneven stages (tied embeddings with PP > 1 build on CUDA
    # only: megatron moves the last stage's head copy to the GPU to sync it with the embedding)
    "qwen2_tp2_pp2": dict(family="qwen2", tp=2, pp_layers=(3, 1), ep=1, etp=1,
                          dims=dict(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=33)),
    # experts over EP and split over expert-TP: local_shards gathers them into the resharder's layout
    "qwen3_moe_tp2_ep2_etp2": dict(family="qwen3_moe", tp=2, pp_layers=(), ep=2, etp=2,
                                   dims=dict(num_heads=4, num_kv_heads=2, head_dim=16)),
    "qwen3_moe_tp1_pp2_ep2": dict(family="qwen3_moe", tp=1, pp_layers=(1, 1), ep=2, etp=1, dims={}),
    # MLA (q/kv down projections whole on every TP rank), a dense first layer, EP2
    "deepseek_v3_tp2_ep2": dict(family="deepseek_v3", tp=2, pp_layers=(), ep=2, etp=1, dims={}),
}


def _batch(vocab: int, n: int = 5):
    """The same random prompts (3-11 tokens) and responses (2-8) on every rank."""
    from rlrecipes.engines.base import SeqBatch

    g = torch.Generator().manual_seed(1)
    lens = [(int(torch.randint(3, 12, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g)))
            for _ in range(n)]
    return SeqBatch(prompts=[torch.randint(1, vocab, (p,), generator=g) for p, _ in lens],
                    responses=[torch.randint(1, vocab, (r,), generator=g) for _, r in lens])


def _check_gradients(model, hf_model, dims, r, layout, rank, groups, specs):
    """Backward of the summed response log-probs through megatron's modules (TP2 with sequence
    parallelism, EP) on every rank (each DP rank the same batch), then megatron DDP's reduction and the
    TP sum ``finalize_model_grads`` applies (parameters tagged ``sequence_parallel``, and q/k norms),
    give each rank exactly its slice of the HF model's gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlrecipes.core.resharder.layout import shard_for
    from rlrecipes.engines.megatron import shard
    from rlrecipes.engines.native import batching

    batch = _batch(dims.vocab_size)
    hf_model.zero_grad(set_to_none=True)
    for p, resp in zip(batch.prompts, batch.responses):
        logits = hf_model(input_ids=torch.cat([p, resp])[None]).logits.float()[0, p.numel() - 1:-1]
        torch.log_softmax(logits, -1).gather(-1, resp[:, None]).sum().backward()
    eng = engine_pieces(model.train(), dims, r)
    model.zero_grad(set_to_none=True)
    with megatron_on_cpu():
        for mb in batching.micro_batches(batch, 4, 0):
            d = eng._device_batch(mb)
            logp, _ = eng._logprobs(model(d["ids"], d["pos"], attention_mask=None).float(), mb, False)
            (logp * mb["response_mask"]).sum().backward()
    cfg = model.config
    dp_group, edp_group = ps.get_data_parallel_group(), ps.get_expert_data_parallel_group()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        # megatron DDP: every gradient scaled by 1 / DP, then summed over DP (experts: over expert-DP;
        # an expert sees the tokens of every DP rank, here the same batch on each)
        g = g / dp_group.size()
        dist.all_reduce(g, group=dp_group if getattr(p, "allreduce", True) else edp_group)
        # finalize_model_grads: the TP sum of sequence-parallel and q/k-norm gradients
        if (cfg.sequence_parallel and getattr(p, "sequence_parallel", False)) or \
                (cfg.qk_layernorm and ("q_layernorm" in n or "k_layernorm" in n)):
            dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        grads[n] = g
    mine = shard.resharder_shards(shard.hf_from_shard(grads, dims, r), dims, r, groups)
    ref = {n: p.grad for n, p in hf_model.named_parameters() if p.grad is not None}
    for s in specs:
        if s.name not in ref:  # a buffer (the router's score-correction bias): no gradient
            continue
        want = shard_for(s, ref[s.name], layout, rank)
        if want is None:
            continue
        if s.kind == "vocab" or s.name == "lm_head.weight":
            a, b, _ = shard.vocab_range(dims.vocab_size, r)
            want = ref[s.name][a:b]
        err = float((mine[s.name] - want).abs().max())
        assert err <= 1e-4 * (1 + float(want.abs().max())), (rank, s.name, err)
    model.zero_grad(set_to_none=True)
    model.eval()


def _worker(rank, port, case, tmp):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RLRECIPES_DEVICE="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from megatron.core import parallel_state as ps

    from rlrecipes.core.parallel import ParallelLayout
    from rlrecipes.core.resharder.layout import shard_for
    from rlrecipes.engines.megatron import shard, state
    from rlrecipes.engines.megatron.model import build_gpt, load_megatron_state
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.models import SMOKE, param_specs

    c = CASES[case]
    dims = dataclasses.replace(SMOKE[c["family"]], **c["dims"])
    tp, pp_layers, ep, etp = c["tp"], c["pp_layers"], c["ep"], c["etp"]
    pp = max(len(pp_layers), 1)
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    r = shard.Ranks(tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(), pp_layers=pp_layers,
                    pp_rank=ps.get_pipeline_model_parallel_rank(), ep=ep, ep_rank=ps.get_expert_model_parallel_rank(),
                    etp=etp, etp_rank=ps.get_expert_tensor_parallel_rank())
    # the engine's config (layout.engine_config_kwargs: sequence parallelism with TP2); MoE: the
    # all-to-all dispatcher wants a CUDA stream when built, the all-gather one builds on CPU (same
    # parameters) but megatron refuses it with variable_seq_lengths
    over = dict(moe_token_dispatcher_type="allgather", variable_seq_lengths=False) if dims.is_moe else None
    hf_model, _ = build_model(dims, seed=5)
    hf = hf_model.state_dict()
    with megatron_on_cpu():
        model = build_gpt(dims, hf_config=hf_model.config, ranks=r, cpu_init=True, overrides=over,
                          pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    assert model.config.sequence_parallel == (tp > 1)
    mg = shard.megatron_shard(shard.full_reader(hf), dims, r)
    real = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert real == {k: tuple(v.shape) for k, v in mg.items()}, (rank, sorted(set(real) ^ set(mg)))
    load_megatron_state(model, mg)
    # norms take a slice of the sequence under sequence parallelism: tagged so megatron sums their grads over TP
    assert all(getattr(p, "sequence_parallel", False) == (tp > 1) for n, p in model.named_parameters()
               if n.endswith("layernorm.weight"))

    if pp == 1:  # the forward with TP / SP / EP over gloo: the engine's rows and vocab-parallel log-probs
        batch = _batch(dims.vocab_size)
        with megatron_on_cpu():
            got, ent = engine_logprobs(engine_pieces(model.eval(), dims, r), batch)
        want, went = hf_logprobs(hf_model.eval(), batch)
        assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-4, rank
        assert max(float((a - b).abs().max()) for a, b in zip(ent, went)) < 1e-4, rank

    # local_shards, as the engine computes them, against the resharder's slices
    layout = ParallelLayout.of(tp, pp, ep, WORLD // (tp * pp), pp_layers or None)
    sd = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    groups = shard.ExpertGroups(etp=ps.get_expert_tensor_parallel_group(), ep=ps.get_expert_model_parallel_group(),
                                rank_in_stage=rank % layout.stage_size)
    mine = shard.resharder_shards(shard.hf_from_shard(sd, dims, r), dims, r, groups)
    specs = param_specs(dims, pp_layers or None)

    if pp == 1:  # gradients under sequence parallelism: the engine's tagging makes megatron's TP sum right
        _check_gradients(model, hf_model, dims, r, layout, rank, groups, specs)

    for s in specs:
        want = shard_for(s, hf[s.name], layout, rank)
        if want is None:
            assert s.name not in mine, (rank, s.name)
        elif s.kind == "vocab" or s.name == "lm_head.weight":  # padded vocabulary: megatron's rows, not even chunks
            a, b, _ = shard.vocab_range(dims.vocab_size, r)
            assert torch.equal(mine[s.name], hf[s.name][a:b]), (rank, s.name)
        else:
            assert tuple(mine[s.name].shape) == tuple(want.shape), (rank, s.name)
            assert torch.equal(mine[s.name], want), (rank, s.name)

    # export: every parameter gathered on rank 0 equals the HF model's
    got = {}
    shard.gather_full(specs, mine, layout, rank, got.__setitem__)
    if rank == 0:
        assert set(got) == {s.name for s in specs}
        assert all(torch.equal(got[k], hf[k]) for k in got)

    # per-rank checkpoint round trip (model part; the optimizer needs megatron DDP, CUDA) and the manifest check
    rec = {"tp": tp, "pp_layers": list(pp_layers), "ep": ep, "etp": etp}
    state.save(tmp, model, None, layout=rec, step=3)
    before = {k: v.clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert state.load(tmp, model, None, layout=rec) == 3
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if torch.is_tensor(v))
    with pytest.raises(ValueError, match="saved with another layout; tp"):
        state.load(tmp, model, None, layout=dict(rec, tp=tp * 2))

    # offload moves the parameters' storages to host and brings them back in place
    ts = state.device_tensors(model, None, torch.device("cpu"))
    assert len(ts) == len(list(model.parameters()))
    swapped = state.offload(model, None, torch.device("cpu"))
    assert swapped.device_nbytes() == 0
    swapped.restore()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if torch.is_tensor(v))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_modules_match_the_slices_and_specs(case, tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, case, str(tmp_path / "ckpt")), nprocs=WORLD, join=True)
