"""Native engines on one process (a 1-rank gloo group in-process; no spawned processes)."""
from __future__ import annotations


import pytest
import torch

from rlrecipes.engines.native import parallel as par
from rlrecipes.engines.native import shards as shard_ops
from rlrecipes.engines.native.loader import build_model, check_hf_folder
from rlrecipes.engines.native.rollout import NativeRolloutEngine, left_pad, sample_next
from rlrecipes.models import SMOKE


pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def _prompts(seed=0, lens=(3, 7, 5)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 32, (n,), generator=g) for n in lens]


@pytest.mark.parametrize("family", list(SMOKE))
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_greedy_equals_hf_generate(family, cache):
    eng = NativeRolloutEngine(SMOKE[family], device="cpu", cache=cache)
    prompts = _prompts()
    out = eng.sample(prompts, max_new_tokens=10, temperature=0)
    ids, am = left_pad(prompts, 0)
    vl = getattr(eng, "_vision", None)  # a VL model never samples its image / video tokens
    ref = eng.model.generate(input_ids=ids, attention_mask=am, do_sample=False, max_new_tokens=10,
                             min_new_tokens=10, pad_token_id=0, eos_token_id=None,
                             **({"suppress_tokens": list(vl.special_ids)} if vl else {}))[:, ids.shape[1]:]
    for i in range(len(prompts)):
        assert torch.equal(out.responses[i], ref[i]), (i, out.responses[i], ref[i])
    # top-k = 1 sampling is greedy
    k1 = eng.sample(prompts, max_new_tokens=10, temperature=1.0, top_k=1, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(k1.responses, out.responses))


def test_logprobs_equal_recomputed_forward_and_seeded():
    eng = NativeRolloutEngine(SMOKE["qwen2"], device="cpu")
    prompts = _prompts(1)
    out = eng.sample(prompts, max_new_tokens=8, temperature=1.0, seed=11)
    again = eng.sample(prompts, max_new_tokens=8, temperature=1.0, seed=11)
    assert all(torch.equal(a, b) for a, b in zip(out.responses, again.responses))
    model = eng.model
    for p, r, lp in zip(prompts, out.responses, out.log_probs):
        seq = torch.cat([p, r])[None]  # [1, P + R]
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(p) - 1:-1].float()  # [R, V]
        want = torch.log_softmax(logits, -1).gather(-1, r[:, None]).squeeze(-1)
        torch.testing.assert_close(lp, want, atol=1e-4, rtol=1e-4)


def test_eos_stops_and_is_kept():
    eng = NativeRolloutEngine(SMOKE["qwen2"], device="cpu")
    prompts = _prompts(2)
    greedy = eng.sample(prompts, max_new_tokens=12, temperature=0)
    eos = int(greedy.responses[0][3])  # a token the first sequence emits at step 3 (or earlier)
    out = eng.sample(prompts, max_new_tokens=12, temperature=0, eos_token_id=eos)
    for full, cut in zip(greedy.responses, out.responses):
        hits = (full == eos).nonzero()
        n = int(hits[0]) + 1 if len(hits) else len(full)
        assert torch.equal(cut, full[:n])
    assert [len(x) for x in out.log_probs] == [len(x) for x in out.responses]
    assert out.responses[0][-1].item() == eos and len(out.responses[0]) <= 4


def test_sample_next_top_p_top_k_support():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0, -2.0]]).repeat(64, 1)  # [64, 5]
    tok, lp = sample_next(logits, temperature=1.0, top_k=2, top_p=1.0, generator=g)
    assert set(tok.tolist()) <= {0, 1}
    tok, _ = sample_next(logits, temperature=1.0, top_k=0, top_p=0.5, generator=g)
    assert set(tok.tolist()) == {0}  # p(token 0) = 0.72 > 0.5
    # the returned log-prob is from the untruncated temperature-scaled distribution
    tok, lp = sample_next(logits, temperature=2.0, top_k=1, top_p=1.0, generator=g)
    want = torch.log_softmax(logits / 2.0, -1)[:, 0]
    assert torch.equal(tok, torch.zeros_like(tok))
    torch.testing.assert_close(lp, want)


def test_sleep_wake_and_load_shards():
    eng = NativeRolloutEngine(SMOKE["qwen3_moe"], device="cpu", seed=1)
    ref, _ = build_model(SMOKE["qwen3_moe"], seed=0)
    assert eng.load_shards(ref.state_dict().items()) == len(ref.state_dict())
    prompts = _prompts(3)
    a = eng.sample(prompts, max_new_tokens=6, temperature=0)
    eng.sleep(weights=True)
    with pytest.raises(RuntimeError, match="wake"):
        eng.sample(prompts, max_new_tokens=2)
    eng.wake()
    b = eng.sample(prompts, max_new_tokens=6, temperature=0)
    assert all(torch.equal(x, y) for x, y in zip(a.responses, b.responses))
    with pytest.raises(ValueError, match="shape"):
        eng.load_shards([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(KeyError, match="not a parameter"):
        eng.load_shards([("model.nope.weight", torch.zeros(3))])


def test_train_engine_single_rank_offload_roundtrip():
    from rlrecipes.engines.native.train import NativeTrainEngine

    class SeparateHost(NativeTrainEngine):  # on CPU host memory is device memory: take the offload path anyway
        host_is_device = False

    eng = SeparateHost(SMOKE["qwen2"], layout=(1, 1), device="cpu", lr=1e-3)
    ids = torch.randint(1, 32, (2, 9))
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": torch.ones(2, 4)}
    m = eng.train_micro_batches([mb], lambda lp, ent, b: (-lp.mean() + 0 * ent.mean(), {}), with_entropy=True)
    assert m["actor/skipped_step"] == 0.0 and m["actor/grad_norm"] > 0
    before = eng.full_state_dict()
    eng.offload()
    assert all(p.untyped_storage().nbytes() == 0 for p in eng.model.parameters())
    eng.onload()
    for k, v in eng.full_state_dict().items():
        assert torch.equal(v, before[k])
    m = eng.train_micro_batches([mb], lambda lp, ent, b: (lp.mean() * float("inf"), {}))
    assert m["actor/skipped_step"] == 1.0


def test_layout_errors():
    from rlrecipes.core.mesh import build_mesh
    from rlrecipes.core.parallel import ParallelLayout

    with pytest.raises(ValueError, match="a layout over 2 devices on a world of 1 ranks"):
        build_mesh(ParallelLayout(role="actor", tp=2, world=2), "cpu")
    with pytest.raises(ValueError, match="TP\\*PP divides the world: actor: TP2 x PP1 = 2 does not divide 1 devices"):
        build_mesh(ParallelLayout(role="actor", tp=2, world=1), "cpu")
    with pytest.raises(ValueError, match="EP2 does not divide TP1 \\(engine native\\); use ep <= tp with tp % ep == 0 "
                                         "\\(actor.layout.ep\\)"):
        build_mesh(ParallelLayout(role="actor", tp=1, ep=2, world=1), "cpu")


def test_param_rules_follow_conventions():
    r = par.param_rule
    assert r("model.embed_tokens.weight") == "vocab" and par.tp_dim("model.embed_tokens.weight") == 0
    assert r("lm_head.weight") == "col"
    assert r("model.layers.0.self_attn.q_proj.bias") == "col"
    assert r("model.layers.0.self_attn.kv_b_proj.weight") == "col"
    assert r("model.layers.0.mlp.shared_experts.up_proj.weight") == "col"
    assert par.tp_dim("model.layers.0.self_attn.o_proj.weight") == 1
    assert par.tp_dim("model.layers.0.mlp.shared_experts.down_proj.weight") == 1
    for name in ("model.norm.weight", "model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.mlp.gate.e_score_correction_bias",
                 "model.layers.0.self_attn.q_a_layernorm.weight"):
        assert r(name) == "replicate", name
    assert par.is_expert("model.layers.3.mlp.experts.down_proj")
    full = torch.arange(8 * 6).reshape(8, 6)
    assert torch.equal(shard_ops.convention_slice(full, "model.layers.0.mlp.experts.down_proj", 2, 1, 2, 1), full[4:])
    assert torch.equal(shard_ops.convention_slice(full, "model.layers.0.self_attn.o_proj.weight", 2, 1, 1, 0), full[:, 3:])


@pytest.mark.parametrize("family", list(SMOKE))
def test_loader_roundtrip_and_export(tmp_path, family):
    """save_pretrained folder -> real loading path -> TrainEngine -> export_hf -> from_pretrained -> generate."""

    from rlrecipes.engines.native.train import NativeTrainEngine

    src, _ = build_model(SMOKE[family], seed=3)
    src.save_pretrained(tmp_path / "src", safe_serialization=True)
    eng = NativeTrainEngine(str(tmp_path / "src"), role="ref", layout=(1, 1), device="cpu")
    assert eng.dims.family == family
    for k, v in eng.full_state_dict().items():
        assert torch.equal(v, src.state_dict()[k]), k
    eng.export_hf(tmp_path / "out")
    from rlrecipes.engines.native.loader import auto_class  # a VL family: image-text-to-text

    back = auto_class(eng.model.config).from_pretrained(tmp_path / "out", local_files_only=True)
    for k, v in back.state_dict().items():
        assert torch.equal(v, src.state_dict()[k]), k
    gen = back.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                            pad_token_id=0)
    assert gen.shape == (1, 7)
    roll = NativeRolloutEngine(str(tmp_path / "out"), device="cpu")
    assert roll.dims.family == family


@pytest.mark.parametrize("role", ["actor", "ref"])
def test_tied_head_stays_tied_through_the_meta_build(tmp_path, role):
    """meta -> device gives each module its own tensor; the loader re-ties the head to the embedding."""
    import dataclasses

    from rlrecipes.engines.native.train import NativeTrainEngine

    src, _ = build_model(dataclasses.replace(SMOKE["qwen2"], tie_embeddings=True), seed=3)
    src.save_pretrained(tmp_path / "src", safe_serialization=True)
    eng = NativeTrainEngine(str(tmp_path / "src"), role=role, layout=(1, 1), device="cpu")
    assert eng.model.lm_head.weight is eng.model.get_input_embeddings().weight
    assert sum(p.numel() for p in eng.model.parameters()) == sum(p.numel() for p in src.parameters())


def test_loader_refuses_missing_and_pickles(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_hf_folder(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="pickled weights are refused"):
        check_hf_folder(tmp_path / "m")


#: families the hand-written decoder runs (a VL model's decoder sits under model.model.language_model:
#: the native rollout runs it through HF's forward with its pixels, engines/native/vision.py)
FAST = [f for f in SMOKE if not SMOKE[f].has_vision]


@pytest.mark.parametrize("family", FAST)
def test_fast_decode_matches_model_forward_path(family):
    """The hand-written decode steps, the HF-layer decode steps and plain model.forward agree."""
    prompts = _prompts(4, lens=(2, 6, 4, 6))  # padded rows exercise the keep-mask
    outs = {}
    for decode in ("fast", "layers", "hf"):
        eng = NativeRolloutEngine(SMOKE[family], device="cpu", decode=decode)
        assert eng.decode_path == decode
        greedy = eng.sample(prompts, max_new_tokens=9, temperature=0)
        sampled = eng.sample(prompts, max_new_tokens=9, temperature=0.8, top_p=0.95, seed=2)
        outs[decode] = (greedy, sampled)
    if family != "qwen2":
        assert {"gqa", "mla"} & set(NativeRolloutEngine(SMOKE[family], device="cpu")._fast.kinds)
    for decode in ("layers", "hf"):
        for a, b in zip(outs["fast"], outs[decode]):
            for x, y in zip(a.responses, b.responses):
                assert torch.equal(x, y), (decode, x, y)
            for x, y in zip(a.log_probs, b.log_probs):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_fast_decode_buffers_static_reuse_and_dynamic_release():
    prompts = _prompts(5)
    eng = NativeRolloutEngine(SMOKE["qwen2"], device="cpu", cache="static")
    eng.sample(prompts, max_new_tokens=4, temperature=0)
    k0 = eng._fast.buffers.keys[0]
    eng.sample(prompts, max_new_tokens=4, temperature=0)
    assert eng._fast.buffers.keys[0] is k0  # same batch shape: buffers reused, not re-allocated
    eng.sleep()
    assert eng._fast.buffers.nbytes() == 0
    dyn = NativeRolloutEngine(SMOKE["qwen2"], device="cpu", cache="dynamic")
    dyn.sample(prompts, max_new_tokens=4, temperature=0)
    assert dyn._fast.buffers.nbytes() == 0  # released after the call
    with pytest.raises(ValueError, match="decode"):
        NativeRolloutEngine(SMOKE["qwen2"], device="cpu", decode="nope")


def test_draw_is_multinomial():
    from rlrecipes.engines.native.rollout import _draw

    probs = torch.rand(32, 50).softmax(-1)
    probs[:, :10] = 0.0  # zero-probability tokens are never drawn
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for _ in range(20):
        want = torch.multinomial(probs, 1, generator=g1).squeeze(-1)
        got = _draw(probs.clone(), g2)
        assert torch.equal(got, want)
        assert bool((got >= 10).all())


@pytest.mark.parametrize("family", FAST)
@pytest.mark.parametrize("lens", [(2, 6, 4, 6), (5, 5, 5)])  # padded rows (causal + padding mask) / none
def test_fast_prefill_matches_hf_prefill(family, lens):
    """The hand-written prefill writes the K/V (and logits) of an HF forward + cache copy into the buffers."""
    prompts = _prompts(6, lens=lens)
    fast = NativeRolloutEngine(SMOKE[family], device="cpu", prefill="fast")
    ref = NativeRolloutEngine(SMOKE[family], device="cpu", prefill="hf")
    assert fast.prefill_path == "fast" and ref.prefill_path == "hf"
    assert fast._fast.fast_prefill
    ids, pmask = left_pad(prompts, 0)
    pos = (pmask.cumsum(-1) - 1).clamp(min=0)
    lf, _ = fast._prefill_fast(ids, pmask, pos, 4)
    lr, _ = ref._prefill_fast(ids, pmask, pos, 4)
    torch.testing.assert_close(lf, lr, atol=1e-5, rtol=1e-5)
    bf, br = fast._fast.buffers, ref._fast.buffers
    assert bf.length == br.length == ids.shape[1] and bf.capacity == br.capacity
    real = pmask.bool()[:, None, :, None]  # padded positions' states are never attended to
    n = ids.shape[1]
    for kf, kr in zip(bf.keys + bf.values, br.keys + br.values):
        # MLA values are stored zero-padded to the key width by the fast prefill
        assert kf.shape[:3] == kr.shape[:3] and kf.shape[3] >= kr.shape[3]
        dv = kr.shape[3]
        torch.testing.assert_close(kf[:, :, :n, :dv] * real, kr[:, :, :n] * real, atol=1e-5, rtol=1e-5)
        assert not kf[:, :, :n, dv:].any()
    for kw in ({"temperature": 0}, {"temperature": 0.9, "top_k": 20, "seed": 4}):
        for n_new in (1, 7):
            a = fast.sample(prompts, max_new_tokens=n_new, **kw)
            b = ref.sample(prompts, max_new_tokens=n_new, **kw)
            for x, y in zip(a.responses, b.responses):
                assert torch.equal(x, y), (kw, n_new, x, y)
            for x, y in zip(a.log_probs, b.log_probs):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_prefill_path_fallbacks():
    assert NativeRolloutEngine(SMOKE["qwen2"], device="cpu").prefill_path == "fast"
    layers = NativeRolloutEngine(SMOKE["qwen2"], device="cpu", decode="layers")
    assert layers.prefill_path == "hf" and not layers._fast.fast_prefill
    with pytest.raises(RuntimeError, match="prefill"):
        layers._fast.prefill(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                             torch.arange(2)[None], capacity=3, steps=1)
    assert NativeRolloutEngine(SMOKE["qwen2"], device="cpu", decode="hf").prefill_path == "hf"
    with pytest.raises(ValueError, match="prefill"):
        NativeRolloutEngine(SMOKE["qwen2"], device="cpu", prefill="nope")


def test_native_engines_implement_the_interface_through_the_registry():
    """Built from an EngineSpec by name, used only through engines/base.py, as the workflow does."""
    from rlrecipes.engines.base import EngineSpec, RolloutEngine, SamplingParams, SeqBatch, TrainEngine
    from rlrecipes.engines.native.batching import pad_sequences
    from rlrecipes.engines.registry import build_rollout_engine, build_train_engine

    spec = dict(model=SMOKE["qwen2"], device=torch.device("cpu"), seed=0, micro_batch_size=2, lr=1e-3)
    actor = build_train_engine("native", EngineSpec(role="actor", **spec))
    roll = build_rollout_engine("native", EngineSpec(role="rollout", **spec))
    critic = build_train_engine("native", EngineSpec(role="critic", **spec))
    assert isinstance(actor, TrainEngine) and isinstance(roll, RolloutEngine) and isinstance(critic, TrainEngine)
    assert (actor.dp_rank, actor.dp_size, actor.is_data_leader) == (0, 1, True)
    prompts = _prompts()
    out = roll.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0), seed=3)
    again = roll.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0), seed=3)
    assert [r.tolist() for r in out.responses] == [r.tolist() for r in again.responses]
    # forward on an unpadded batch = the padded log-probs, cut to each response
    batch = SeqBatch(prompts, out.responses)
    logp, ent = actor.forward(batch, with_entropy=True)
    mb = pad_sequences(prompts, out.responses, 0)
    full, _ = actor.log_probs(mb)
    for i, r in enumerate(out.responses):
        assert logp[i].shape == r.shape and ent[i].shape == r.shape
        torch.testing.assert_close(logp[i], full[i, :r.numel()])
    # the trainer's log-probs of the rollout's own weights match the sampled ones (same weights)
    roll.update_weights([list(actor.local_shards().items())])
    lp2 = roll.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0), seed=3).log_probs
    for a, b in zip(lp2, actor.forward(batch)[0]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # a train step from the unpadded batch: per-sample and per-token columns laid out like logp
    batch.per_sample["advantages"] = torch.tensor([1.0, -1.0, 0.5])
    batch.per_token["old"] = [torch.zeros(r.numel()) for r in out.responses]
    seen = []

    def loss_fn(lp, _ent, m):
        assert m["advantages"].shape == lp.shape == m["old"].shape == m["response_mask"].shape
        seen.append(lp.shape[0])
        return -(lp * m["advantages"] * m["response_mask"]).sum() / 10, {"x": 1.0}

    m = actor.train_step(batch, loss_fn)
    assert seen == [2, 1] and m["actor/micro_batches"] == 2 and m["actor/skipped_step"] == 0.0 and m["x"] == 1.0
    assert len(actor.param_specs()) == len(actor.local_shards())


def test_empty_rank_still_steps_in_collectives():
    from rlrecipes.engines.base import EngineSpec, SeqBatch
    from rlrecipes.engines.registry import build_train_engine

    actor = build_train_engine("native", EngineSpec(model=SMOKE["qwen2"], role="actor", device=torch.device("cpu")))
    assert actor.forward(SeqBatch([], [])) == ([], None)
    assert actor.train_step(SeqBatch([], []), lambda *a: (torch.zeros(()), {}))["actor/skipped_step"] == 1.0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_trained_moe_and_mla_export_loads_with_per_expert_keys_and_same_logits(tmp_path, family):
    """Train a few steps, export, load with from_pretrained: per-expert keys on disk, equal logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rlrecipes.engines.native.train import NativeTrainEngine

    eng = NativeTrainEngine(SMOKE[family], layout=(1, 1), device="cpu", lr=1e-2, seed=5)
    before = {k: v.clone() for k, v in eng.full_state_dict().items()}
    ids = torch.randint(1, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": torch.ones(2, 4)}
    for _ in range(3):
        eng.train_micro_batches([mb], lambda lp, ent, b: (-lp.mean(), {}))
    trained = eng.full_state_dict()
    experts = [k for k in trained if k.endswith("mlp.experts.gate_up_proj")]
    assert experts and not torch.equal(trained[experts[0]], before[experts[0]]), "the experts must have trained"
    eng.export_hf(tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    E = SMOKE[family].num_experts
    layer = experts[0].rsplit(".mlp.", 1)[0]
    for e in range(E):
        for part in ("gate_proj", "up_proj", "down_proj"):
            assert f"{layer}.mlp.experts.{e}.{part}.weight" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    from rlrecipes.engines.native.loader import auto_class  # a VL family: image-text-to-text

    back = auto_class(eng.model.config).from_pretrained(tmp_path / "out", local_files_only=True).eval()
    for k, v in back.state_dict().items():
        assert torch.equal(v, trained[k]), k
    x = torch.randint(1, 32, (2, 11), generator=torch.Generator().manual_seed(2))
    eng.model.eval()
    with torch.no_grad():
        want = eng.model(input_ids=x).logits
        got = back(input_ids=x).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_dp1_engine_is_the_plain_module_and_trains_like_fsdp(random_seq_batch, pg_loss):
    """At world size 1 (fp32) the actor is the HF module itself (no FSDP2 wrapper) and its steps,
    grad norms and forwards equal the FSDP2-wrapped engine's on the same rank bit for bit."""
    from torch.distributed.fsdp import FSDPModule

    from rlrecipes.engines.native.train import NativeTrainEngine

    engs = [NativeTrainEngine(SMOKE["qwen2"], lr=1e-2, seed=0, grad_clip=0.5, fsdp=f, max_tokens_per_micro_batch=40)
            for f in (None, True)]
    assert not engs[0].fsdp and not isinstance(engs[0].model, FSDPModule)
    assert type(engs[0].model).__name__ == "Qwen2ForCausalLM" and isinstance(engs[1].model, FSDPModule)
    for step in range(3):
        batch = random_seq_batch(32, n=9, seed=step)
        plain, wrapped = (e.train_step(batch, pg_loss) for e in engs)
        assert plain["actor/micro_batches"] > 1 and plain == wrapped
        (lp_a, ent_a), (lp_b, ent_b) = (e.forward(batch, with_entropy=True) for e in engs)
        assert all(torch.equal(a, b) for a, b in zip(lp_a + ent_a, lp_b + ent_b))
    sa, sb = (e.full_state_dict() for e in engs)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_forward_leaves_train_mode_as_it_was():
    from rlrecipes.engines.base import SeqBatch
    from rlrecipes.engines.native import train

    actor = train.NativeTrainEngine(SMOKE["qwen2"], lr=1e-3)
    ref = train.NativeTrainEngine(SMOKE["qwen2"], role="ref")
    batch = SeqBatch(_prompts(), [torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([4, 5, 6])])
    seen = []
    hook = actor.model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(m.training))
    actor.forward(batch)
    assert seen == [False] and actor.model.training and all(m.training for m in actor.model.modules())
    actor.train_step(batch, lambda lp, _e, mb: (-(lp * mb["response_mask"]).sum(), {}))
    assert seen == [False, True]
    hook.remove()
    ref.forward(batch)
    assert not any(m.training for m in ref.model.modules())
