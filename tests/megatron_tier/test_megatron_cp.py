"""megatron-core tier: context parallelism (``layout.sp`` -> megatron's ``context_parallel_size``) as far
as it runs on CPU.

What runs: the load-balanced split / unsplit (``engines/megatron/cp.py``) against Megatron-LM's own
``get_batch_on_this_cp_rank``; the autograd-aware log-prob gather over a real CP group (gloo); megatron's
``parallel_state`` initialised with ``context_parallel_size=2`` and the engine's data contract on it
(DP rank / size, data leader, the TP x CP x PP "same data" group, the workflow's row share over it);
the engine's CP log-probs and the parameter gradients of a loss through megatron's own
``forward_step`` / ``backward_step`` (its CP loss scaling) and DDP's 1 / (DP x CP) average, against
the HF model; the refusal without TransformerEngine; the layer spec with TE's attention.

What cannot run here: CP attention itself. megatron's local ``DotProductAttention`` asserts a CP size
of 1, TransformerEngine (CUDA) and MindSpeed (Ascend) are not installed, and megatron's RoPE slicing
for CP allocates pinned CUDA memory. The model on each CP rank is therefore the whole-sequence model
whose output is cut to the rank's columns: exactly what a CP forward returns on that rank (megatron's
contract), while the attention's ring exchange is TE's / MindSpeed's and is checked on devices only.
"""
import dataclasses
import importlib.util
import inspect
import os
import socket
from collections import defaultdict
from functools import partial

import pytest
import torch

pytest.importorskip("megatron.core")

from cpu_shims import engine_pieces, hf_logprobs, megatron_on_cpu  # noqa: E402

from rlrecipes.engines.megatron import cp as cpmod  # noqa: E402

pytestmark = pytest.mark.megatron

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


# ------------------------------------------------------------------------------------- (a) the split
def test_split_round_trips_and_balances_the_causal_work():
    g = torch.Generator().manual_seed(0)
    for cp in (1, 2, 3, 4):
        for T in (2 * cp, 6 * cp):
            x = torch.randn(3, T, 5, generator=g)
            parts = [cpmod.split(x, cp, r) for r in range(cp)]
            assert all(p.shape == (3, T // cp, 5) for p in parts)
            assert torch.equal(cpmod.unsplit(parts), x)
            cols = [cpmod.chunk_columns(T, cp, r) for r in range(cp)]
            assert sorted(torch.cat(cols).tolist()) == list(range(T))  # a partition of the columns
            # causal attention work of a column ~ its position + 1: every rank gets the same total
            assert len({int((c + 1).sum()) for c in cols}) == 1
    assert cpmod.chunk_columns(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cpmod.chunk_columns(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="2 \\* CP = 4"):
        cpmod.chunk_columns(6, 2, 0)


def test_padded_length_and_labels():
    from rlrecipes.engines.megatron.layout import padded_length

    # 2 * cp chunks; each rank's columns a multiple of TP (sequence parallelism); CP 1 as before
    assert [padded_length(n, 1, 2) for n in (5, 8, 9)] == [8, 8, 12]
    assert [padded_length(n, 2, 2) for n in (5, 9)] == [8, 12]
    assert [padded_length(n, 4, 2) for n in (5, 9)] == [8, 16]
    assert padded_length(9, 3, 2) == 12 and padded_length(13, 3, 2) == 24
    assert [padded_length(n, 4) for n in (5, 8, 9)] == [8, 8, 12]
    for n, tp, cp in [(5, 1, 2), (9, 4, 2), (13, 3, 2), (7, 2, 4)]:
        T = padded_length(n, tp, cp)
        assert T >= n and T % (2 * cp) == 0 and (T // cp) % tp == 0
    ids = torch.tensor([[5, 6, 7, 8]])
    assert cpmod.next_token_labels(ids, 0).tolist() == [[6, 7, 8, 0]]


def _megatron_split(batch: dict, group) -> dict:
    """Megatron-LM's own split (megatron/core/utils.py): ``(batch, cp_group)`` in 0.16,
    ``(batch, is_hybrid_cp, cp_group, ...)`` in 0.19."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(dict(batch), cp_group=group)


def _cp_batch(T: int) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (2, T), generator=g)
    return {"tokens": ids, "labels": cpmod.next_token_labels(ids, 0), "loss_mask": torch.rand(2, T, generator=g),
            "position_ids": torch.arange(T).expand(2, T)}


def test_split_matches_megatrons_helper(monkeypatch):
    """Every CP size / rank against ``get_batch_on_this_cp_rank`` in one process: megatron 0.16 reads the
    group's size and rank through ``get_pg_size`` / ``get_pg_rank``, answered here for a stand-in group
    (the 2-rank test below compares on a real gloo CP group, any version)."""
    from megatron.core import utils

    if "is_hybrid_cp" in inspect.signature(utils.get_batch_on_this_cp_rank).parameters:
        pytest.skip("megatron-core >= 0.19 reads the group through torch.distributed: compared on gloo below")
    for cp in (2, 3, 4):
        for rank in range(cp):
            group = object()
            monkeypatch.setattr(utils, "get_pg_size", lambda g, cp=cp: cp)
            monkeypatch.setattr(utils, "get_pg_rank", lambda g, rank=rank: rank)
            batch = _cp_batch(4 * cp)
            got = _megatron_split(batch, group)
            for k, v in batch.items():
                assert torch.equal(got[k], cpmod.split(v, cp, rank)), (cp, rank, k)


# ------------------------------------------------------------------------------------- (c) refusals, spec
def test_engine_refuses_context_parallelism_without_transformer_engine():
    from rlrecipes.engines.megatron.layout import core_attention, layout_problems, mindspeed_args
    from rlrecipes.engines.megatron.train import MegatronTrainEngine
    from rlrecipes.models import SMOKE

    q2 = SMOKE["qwen2"]
    ok = dict(tp=1, pp=1, ep=1, device="cuda", have_te=False, have_mindspeed=False)
    assert layout_problems(q2, **ok) == [] and layout_problems(q2, **dict(ok, sp=2, have_te=True)) == []
    (why,) = layout_problems(q2, **dict(ok, sp=2))
    assert "TransformerEngine" in why and "layout.sp: 1" in why and "actor.engine: native" in why
    assert layout_problems(q2, **dict(ok, sp=2, device="npu", have_mindspeed=True)) == []
    assert core_attention("cuda", True, 2) == "te" and core_attention("npu", False, 2) == "local"
    assert core_attention("cuda", True) == "te" and core_attention("cuda", False) == "local"  # MLA only, as before
    with pytest.raises(RuntimeError, match="TransformerEngine"):
        core_attention("cuda", False, 2)
    assert mindspeed_args(q2) == {} and mindspeed_args(q2, 2) == dict(
        context_parallel_size=2, context_parallel_algo="megatron_cp_algo", attention_mask_type="causal",
        cp_window_size=1, use_cp_send_recv_overlap=False, use_flash_attn=True)
    if HAVE_TE:
        pytest.skip("TransformerEngine is installed: the engine would build CP attention")
    # the engine itself, before any device is touched (the layout rules run first)
    with pytest.raises(RuntimeError, match="TransformerEngine's DotProductAttention") as e:
        MegatronTrainEngine(q2, role="ref", device=torch.device("cuda"), sp=2)
    assert "pip install" in str(e.value)


def test_cp_spec_has_te_attention_in_every_layer_and_the_local_one_refuses_cp():
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from rlrecipes.engines.megatron.layout import engine_config_kwargs
    from rlrecipes.engines.megatron.model import decoder_block_spec, megatron_compat, transformer_config
    from rlrecipes.engines.megatron.shard import Ranks
    from rlrecipes.models import SMOKE

    megatron_compat()
    dims = SMOKE["qwen2"]
    config = transformer_config(dims, engine_config_kwargs(dims, None, Ranks(cp=2), torch.float32), cpu_init=True)
    assert config.context_parallel_size == 2

    def attention_classes(spec):
        return [layer.submodules.self_attention.submodules.core_attention for layer in spec.layer_specs]

    te = attention_classes(decoder_block_spec(config, pp_rank=0, core_attention="te"))
    # (without TE installed megatron's extension module binds a stand-in under the same name)
    assert len(te) == dims.num_layers and all(c is TEDotProductAttention for c in te)
    local = decoder_block_spec(config, pp_rank=0, core_attention="local")  # Ascend: MindSpeed patches this slot
    assert all(c is DotProductAttention for c in attention_classes(local))
    # megatron's own attention asserts CP 1 (dot_product_attention.py): why CP needs TE / MindSpeed
    with pytest.raises(AssertionError, match="only supported by TEDotProductAttention"):
        DotProductAttention(config, 1, AttnMaskType.causal, "self")


def test_data_peer_ranks_follow_megatrons_rank_order():
    from megatron.core.parallel_state import RankGenerator

    for tp, cp, dp, pp in [(1, 2, 1, 1), (1, 2, 2, 1), (2, 2, 2, 1), (2, 4, 1, 2), (4, 2, 2, 2), (1, 3, 2, 3)]:
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        want = sorted(sorted(g) for g in gen.get_ranks("tp-cp-pp"))
        assert sorted(cpmod.data_peer_ranks(tp * cp * dp * pp, tp, cp, pp)) == want, (tp, cp, dp, pp)


# ------------------------------------------------------------------------------------- (b), (d) on gloo
def _check_parallel_state(rank, world, tp, cp, eng):
    """(d): megatron's CP / DP ranks and the engine's data contract on them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlrecipes.core.collectives import all_gather_objects
    from rlrecipes.workflow.batching import share_rows

    dp = world // (tp * cp)
    assert ps.get_context_parallel_world_size() == cp and ps.get_context_parallel_rank() == (rank // tp) % cp
    assert ps.get_data_parallel_world_size() == dp and ps.get_data_parallel_rank() == rank // (tp * cp)
    assert ps.get_data_parallel_group(with_context_parallel=True).size() == dp * cp  # DDP's reduction group
    assert (eng.dp_rank, eng.dp_size) == (rank // (tp * cp), dp)
    group, leader = eng.model_parallel_group()
    members = dist.get_process_group_ranks(group)
    assert len(members) == tp * cp and leader == min(members) and rank in members
    assert set(all_gather_objects(eng.dp_rank, group=group, device=torch.device("cpu"))) == {eng.dp_rank}
    assert eng.is_data_leader == (rank == leader)
    leaders = torch.tensor([int(eng.is_data_leader)])
    dist.all_reduce(leaders)
    assert int(leaders) == dp  # one data leader per DP rank
    # the workflow's share: the leader's rows reach its TP and CP peers
    mine = {"rows": [10 * eng.dp_rank, 10 * eng.dp_rank + 1], "x": torch.arange(4.0) + eng.dp_rank}
    got = share_rows(eng, mine if eng.is_data_leader else {"rows": []}, torch.device("cpu"))
    assert got["rows"] == mine["rows"] and torch.equal(got["x"], mine["x"])


def _check_megatron_split_and_gather(rank, cp):
    """(a) on the real CP group, (b) the autograd gather."""
    from megatron.core import parallel_state as ps

    group, r = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
    batch = _cp_batch(4 * cp)
    got = _megatron_split(batch, group)
    assert all(torch.equal(got[k], cpmod.split(v, cp, r)) for k, v in batch.items())

    T = 6 * cp
    full = torch.randn(3, T, generator=torch.Generator().manual_seed(11))  # the same on every rank
    weight = torch.randn(3, T, generator=torch.Generator().manual_seed(12))
    local = cpmod.split(full, cp, r).clone().requires_grad_(True)
    gathered = cpmod.gather(local, group, cp, r)
    assert torch.equal(gathered, full)
    (weight * gathered ** 2).sum().backward()  # the same loss on every CP rank
    assert torch.allclose(local.grad, cpmod.split(2 * full * weight, cp, r))  # its own columns' gradient, once


def _batch(vocab, n=5):
    from rlrecipes.engines.base import SeqBatch

    g = torch.Generator().manual_seed(1)
    lens = [(int(torch.randint(3, 12, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g)))
            for _ in range(n)]
    responses = [torch.randint(1, vocab, (r,), generator=g) for _, r in lens]
    return SeqBatch(prompts=[torch.randint(1, vocab, (p,), generator=g) for p, _ in lens], responses=responses,
                    per_token={"w": [torch.randn(x.numel(), generator=g) for x in responses]})


BETA = 0.05  # entropy weight in the test loss: the gather of entropies carries gradients too


def _loss_fn(logp, ent, cols):
    m = cols["response_mask"].float()
    loss = (cols["w"] * logp * m).sum() + BETA * (ent * m).sum()
    return loss, {"tokens": float(m.sum())}


def _check_engine_with_cp(rank, world, tp, cp, tmp_eng):
    """The engine's CP rows, log-probs and train-step loss through megatron's forward_step /
    backward_step (which multiply the loss by the CP size), DDP's average over DP x CP, the TP sum of
    sequence-parallel norms: the HF model's log-probs and gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
    from megatron.core.process_groups_config import ProcessGroupCollection

    from rlrecipes.core.parallel import ParallelLayout
    from rlrecipes.core.resharder.layout import shard_for
    from rlrecipes.engines.megatron import shard
    from rlrecipes.engines.megatron.layout import right_align
    from rlrecipes.engines.megatron.model import build_gpt, load_megatron_state
    from rlrecipes.engines.native import batching
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.models import SMOKE, param_specs

    dims = dataclasses.replace(SMOKE["qwen2"], vocab_size=33)  # a vocabulary padded to a multiple of TP
    hf_model, _ = build_model(dims, seed=5)
    r_model = shard.Ranks(tp=tp, tp_rank=ps.get_tensor_model_parallel_rank())  # the whole-sequence model
    singles = [dist.new_group([i]) for i in range(world)]  # its CP group: this rank alone (RoPE unsliced)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    pgc.cp = singles[rank]
    with megatron_on_cpu():
        model = build_gpt(dims, hf_config=hf_model.config, ranks=r_model, cpu_init=True, pg_collection=pgc)
    load_megatron_state(model, shard.megatron_shard(shard.full_reader(hf_model.state_dict()), dims, r_model))
    eng = tmp_eng  # the engine's rows and log-prob code with this rank's CP coordinates
    eng.model, eng.dims = model, dims
    r = eng.ranks
    batch = _batch(dims.vocab_size)

    def cp_forward(mb):
        """What the CP model returns on this rank: the whole sequence's logits, this rank's columns."""
        T = eng._length(mb)
        ids, _ = right_align(mb["input_ids"], mb["attention_mask"], T, eng.pad_token_id)
        d = eng._device_batch(mb)
        assert torch.equal(d["ids"], cpmod.split(ids, cp, r.cp_rank)) and d["ids"].shape[1] == T // cp
        assert torch.equal(d["pos"], cpmod.split(torch.arange(T).expand_as(ids), cp, r.cp_rank))
        return cpmod.split(model(ids, torch.arange(T).expand_as(ids), attention_mask=None), cp, r.cp_rank)

    # log-probs (forward): HF's, on every CP rank
    outs, ents = [None] * len(batch), [None] * len(batch)
    with torch.no_grad(), megatron_on_cpu():
        for mb in batching.micro_batches(batch, 2, 0):
            logp, ent = eng._logprobs(cp_forward(mb).float(), mb, True)
            batching.rows_to_samples(outs, mb, logp, batch)
            batching.rows_to_samples(ents, mb, ent, batch)
    want, went = hf_logprobs(hf_model.eval(), batch)
    assert max(float((a - b).abs().max()) for a, b in zip(outs, want)) < 1e-4, rank
    assert max(float((a - b).abs().max()) for a, b in zip(ents, went)) < 1e-4, rank

    # gradients: megatron's per-micro-batch forward / backward with the engine's loss
    hf_model.zero_grad(set_to_none=True)
    total = 0.0
    for p, resp, w in zip(batch.prompts, batch.responses, batch.per_token["w"]):
        logits = hf_model(input_ids=torch.cat([p, resp])[None]).logits.float()[0, p.numel() - 1:-1]
        lp = torch.log_softmax(logits, -1)
        term = (lp.gather(-1, resp[:, None])[:, 0] * w).sum() + BETA * -(lp.exp() * lp).sum()
        term.backward()
        total += float(term.detach())
    model.train().zero_grad(set_to_none=True)
    mbs = batching.micro_batches(batch, 2, 0)
    n, losses, acc, store = len(mbs), [], defaultdict(list), []
    it = iter(mbs)

    def forward_step_func(_data_iterator, _model):
        mb = next(it)
        return cp_forward(mb), partial(eng._micro_batch_loss, mb, loss_fn=_loss_fn, n=n, with_entropy=True,
                                       losses=losses, acc=acc)

    with megatron_on_cpu():
        for _ in range(n):
            out, _tokens = forward_step(forward_step_func, None, model, n, None, store, model.config,
                                        ps.get_context_parallel_world_size())
            if "model_type" in inspect.signature(backward_step).parameters:  # 0.16; dropped in 0.19
                backward_step(None, out, None, None, model.config)
            else:
                backward_step(None, out, None, model.config)
    assert abs(sum(losses) - total) < 1e-3 * (1 + abs(total)), (rank, sum(losses), total)  # same loss on every CP rank

    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g / dp_cp.size()  # megatron DDP: gradient_scaling_factor = 1 / dp_cp size, then a sum over DP x CP
        dist.all_reduce(g, group=dp_cp)
        if model.config.sequence_parallel and getattr(p, "sequence_parallel", False):  # finalize_model_grads
            dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        grads[name] = g
    mine = shard.hf_from_shard(grads, dims, r_model)
    ref = {k: p.grad for k, p in hf_model.named_parameters() if p.grad is not None}
    layout = ParallelLayout.of(tp, 1, 1, world // tp)  # the resharder's DP counts the CP ranks
    for s in param_specs(dims):
        want = shard_for(s, ref[s.name], layout, rank)
        if s.kind == "vocab" or s.name == "lm_head.weight":
            a, b, _ = shard.vocab_range(dims.vocab_size, r_model)
            want = ref[s.name][a:b]
        err = float((mine[s.name] - want).abs().max())
        assert err <= 1e-4 * (1 + float(want.abs().max())), (rank, s.name, err)


def _worker(rank, port, world, tp, cp):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RLRECIPES_DEVICE="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    from rlrecipes.engines.megatron import shard, train
    from rlrecipes.models import SMOKE

    ps.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    try:
        eng = engine_pieces(None, SMOKE["qwen2"], shard.Ranks(tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(), cp=cp,
                                                              cp_rank=ps.get_context_parallel_rank()))
        eng._data_peers = train._data_group(world, tp, cp, 1)  # what the engine's constructor sets up
        _check_parallel_state(rank, world, tp, cp, eng)
        _check_megatron_split_and_gather(rank, cp)
        _check_engine_with_cp(rank, world, tp, cp, eng)
        dist.barrier()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("world,tp,cp", [(2, 1, 2), (4, 2, 2), (4, 1, 2)], ids=["cp2", "tp2_cp2", "cp2_dp2"])
def test_context_parallel_over_gloo(world, tp, cp):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, world, tp, cp), nprocs=world, join=True)
