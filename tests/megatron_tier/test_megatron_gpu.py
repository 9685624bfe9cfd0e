"""megatron-core on an accelerator: the GPTModel built from the family's config, with converted HF
weights, gives the HF model's logits. Skipped without megatron-core or without CUDA."""
import dataclasses
import socket

import pytest
import torch

pytest.importorskip("megatron.core")

from rlrecipes import device as devmod  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.gpu,
              pytest.mark.skipif(devmod.accelerator() != "cuda", reason="megatron-core computes on CUDA")]


@pytest.fixture(scope="module")
def cuda_model_parallel():
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["qwen2", "qwen2_tied", "qwen3_moe"])
def test_megatron_logits_equal_hf(cuda_model_parallel, family):
    from rlrecipes.engines.megatron.model import build_gpt, load_hf_state
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.models import SMOKE

    dims = dataclasses.replace(SMOKE["qwen2"], tie_embeddings=True) if family == "qwen2_tied" else SMOKE[family]
    torch.backends.cuda.matmul.allow_tf32 = False
    hf_model, _ = build_model(dims, seed=4)
    hf_model = hf_model.cuda().eval()
    model = build_gpt(dims, hf_config=hf_model.config).cuda().eval()
    load_hf_state(model, hf_model.state_dict(), dims)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, dims.vocab_size, (2, 24), generator=g).cuda()
    pos = torch.arange(24, device="cuda").expand(2, -1)
    with torch.no_grad():
        want = hf_model(input_ids=ids).logits.float()
        got = model(ids, pos, attention_mask=None).float()
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < 2e-3, float((got - want).abs().max())


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-3), ("bf16", 0.1)])
def test_engine_logprobs_equal_native_and_a_step_follows_the_advantages(cuda_model_parallel, tmp_path, dtype, tol,
                                                                         random_seq_batch, pg_loss):
    from rlrecipes.engines.megatron.train import MegatronTrainEngine
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.engines.native.train import NativeTrainEngine
    from rlrecipes.models import SMOKE

    torch.backends.cuda.matmul.allow_tf32 = False
    src, dims = build_model(SMOKE["qwen2"], seed=6)
    src.save_pretrained(tmp_path / "src", safe_serialization=True)
    mg = MegatronTrainEngine(str(tmp_path / "src"), device="cuda", dtype=dtype, lr=1e-2, micro_batch_size=4)
    native = NativeTrainEngine(str(tmp_path / "src"), role="ref", layout=(1, 1), device="cuda", dtype=dtype)
    batch = random_seq_batch(dims.vocab_size)
    got, _ = mg.forward(batch)
    want, _ = native.forward(batch)
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    assert diff < tol, diff
    # one step on a policy-gradient loss moves log-probs along the advantages
    m = mg.train_step(batch, pg_loss)
    assert m["actor/skipped_step"] == 0.0 and m["actor/micro_batches"] == 2 and m["actor/grad_norm"] > 0
    after, _ = mg.forward(batch)
    adv = batch.per_sample["advantages"]
    gain = sum(float(adv[i]) * float((after[i] - got[i]).mean()) for i in range(len(batch)))
    assert gain > 0, gain


def test_grpo_steps_on_the_megatron_actor_raise_the_reward(cuda_model_parallel, tmp_path, pg_loss):
    """Rollout (native sampler) -> reward -> GRPO advantages -> megatron train step -> weights back to
    the rollout, a few times: the reward (share of responses' tokens equal to a target) rises."""
    from rlrecipes.algos.advantages import grpo_advantage
    from rlrecipes.engines.base import SeqBatch
    from rlrecipes.engines.megatron.train import MegatronTrainEngine
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.engines.native.rollout import NativeRolloutEngine
    from rlrecipes.models import SMOKE

    src, dims = build_model(SMOKE["qwen2"], seed=7)
    src.save_pretrained(tmp_path / "src", safe_serialization=True)
    actor = MegatronTrainEngine(str(tmp_path / "src"), device="cuda", dtype="fp32", lr=3e-3, micro_batch_size=32)
    roll = NativeRolloutEngine(str(tmp_path / "src"), device="cuda", dtype="fp32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, dims.vocab_size, (4,), generator=g) for _ in range(8)]
    group, target, rewards = 8, 5, []
    for step in range(12):
        roll.load_shards(actor.hf_state_dict().items())
        batch_prompts = [p for p in prompts for _ in range(group)]
        out = roll.sample(batch_prompts, max_new_tokens=6, temperature=1.0, seed=step)
        scores = torch.stack([(r.cpu() == target).float().mean() for r in out.responses])
        mask = torch.ones(len(scores), 6)
        adv, _ = grpo_advantage(scores, mask, group_size=group)
        batch = SeqBatch(prompts=batch_prompts, responses=[r.cpu() for r in out.responses],
                         per_sample={"advantages": adv[:, 0]})
        m = actor.train_step(batch, pg_loss)
        assert m["actor/skipped_step"] == 0.0
        rewards.append(float(scores.mean()))
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


def test_moe_engine_logprobs_equal_native(cuda_model_parallel, tmp_path, random_seq_batch):
    """Qwen3-MoE (routed experts, q/k norms) through the engine on one GPU (EP1 TP1)."""
    from rlrecipes.engines.megatron.train import MegatronTrainEngine
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.engines.native.train import NativeTrainEngine
    from rlrecipes.models import SMOKE

    torch.backends.cuda.matmul.allow_tf32 = False
    src, dims = build_model(SMOKE["qwen3_moe"], seed=8)
    src.save_pretrained(tmp_path / "src", safe_serialization=True)
    mg = MegatronTrainEngine(str(tmp_path / "src"), role="ref", device="cuda", dtype="fp32", micro_batch_size=4)
    native = NativeTrainEngine(str(tmp_path / "src"), role="ref", layout=(1, 1), device="cuda", dtype="fp32")
    batch = random_seq_batch(dims.vocab_size)
    got, ent = mg.forward(batch, with_entropy=True)
    want, went = native.forward(batch, with_entropy=True)
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-3
    assert max(float((a - b).abs().max()) for a, b in zip(ent, went)) < 1e-3


def test_shards_export_checkpoint_and_offload_round_trip(cuda_model_parallel, tmp_path, random_seq_batch, pg_loss):
    """local_shards are the ParamSpecs' slices (one rank: whole tensors) of the weights; export_hf
    writes the source model back exactly; save -> step -> load restores weights and optimizer state
    (the next step is the same as from the saved point); offload frees the buffers, onload restores."""
    from rlrecipes.core.parallel import ParallelLayout
    from rlrecipes.core.resharder.layout import shard_for
    from rlrecipes.engines.megatron.train import MegatronTrainEngine
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.models import SMOKE

    torch.backends.cuda.matmul.allow_tf32 = False
    src, dims = build_model(SMOKE["qwen2"], seed=9)
    src.save_pretrained(tmp_path / "src", safe_serialization=True)
    eng = MegatronTrainEngine(str(tmp_path / "src"), device="cuda", dtype="fp32", lr=1e-2, micro_batch_size=4)
    hf = src.state_dict()
    shards = eng.local_shards()
    for s in eng.param_specs():
        assert torch.equal(shards[s.name].cpu(), shard_for(s, hf[s.name], ParallelLayout.of(1), 0)), s.name
    eng.export_hf(tmp_path / "out")
    back, _ = build_model(str(tmp_path / "out"), seed=0)
    assert all(torch.equal(v, hf[k]) for k, v in back.state_dict().items())

    batch = random_seq_batch(dims.vocab_size)
    eng.train_step(batch, pg_loss)
    eng.save(tmp_path / "ckpt")
    eng.train_step(batch, pg_loss)
    after_two, _ = eng.forward(batch)
    eng.load(tmp_path / "ckpt")
    assert eng.step == 1
    eng.train_step(batch, pg_loss)
    again, _ = eng.forward(batch)
    assert max(float((a - b).abs().max()) for a, b in zip(after_two, again)) < 1e-6

    before = {k: v.clone() for k, v in eng.local_shards().items()}
    held = torch.cuda.memory_allocated()
    eng.offload()
    assert torch.cuda.memory_allocated() < held
    eng.onload()
    assert all(torch.equal(v, before[k]) for k, v in eng.local_shards().items())
    m = eng.train_step(batch, pg_loss)
    assert m["actor/skipped_step"] == 0.0


def test_fp16_scales_the_loss_and_unscales_the_gradients(cuda_model_parallel, tmp_path, random_seq_batch, pg_loss):
    """fp16: the schedule multiplies the loss by the optimizer's dynamic loss scale
    (``config.grad_scale_func``) and the optimizer divides it out: the reported gradient norm is the
    fp32 engine's, not 2**16 times it."""
    from rlrecipes.engines.megatron.layout import FP16_INITIAL_LOSS_SCALE
    from rlrecipes.engines.megatron.train import MegatronTrainEngine
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.models import SMOKE

    torch.backends.cuda.matmul.allow_tf32 = False
    src, dims = build_model(SMOKE["qwen2"], seed=10)
    src.save_pretrained(tmp_path / "src", safe_serialization=True)
    batch = random_seq_batch(dims.vocab_size)
    norms = {}
    for dtype in ("fp32", "fp16"):
        eng = MegatronTrainEngine(str(tmp_path / "src"), device="cuda", dtype=dtype, lr=1e-4, micro_batch_size=4)
        cfg = eng._module().config
        assert cfg.grad_scale_func == eng.optimizer.scale_loss
        if dtype == "fp16":
            assert float(eng.optimizer.get_loss_scale()) == FP16_INITIAL_LOSS_SCALE
        m = eng.train_step(batch, pg_loss)
        assert m["actor/skipped_step"] == 0.0
        norms[dtype] = m["actor/grad_norm"]
        del eng
    assert abs(norms["fp16"] - norms["fp32"]) < 0.05 * norms["fp32"], norms


def test_offloaded_optimizer_keeps_adam_state_on_the_host(cuda_model_parallel, tmp_path, random_seq_batch, pg_loss):
    """offload_optimizer: megatron's HybridDeviceOptimizer with every parameter on the host
    (optimizer_offload_fraction=1.0): a step runs and changes the weights, the Adam state is on CPU."""
    from rlrecipes.engines.megatron.train import MegatronTrainEngine
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.models import SMOKE

    src, dims = build_model(SMOKE["qwen2"], seed=11)
    src.save_pretrained(tmp_path / "src", safe_serialization=True)
    eng = MegatronTrainEngine(str(tmp_path / "src"), device="cuda", dtype="bf16", lr=1e-3, micro_batch_size=4,
                              offload_optimizer=True)
    before = {k: v.clone() for k, v in eng.local_shards().items()}
    m = eng.train_step(random_seq_batch(dims.vocab_size), pg_loss)
    assert m["actor/skipped_step"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in eng.local_shards().items())
    from rlrecipes.engines.megatron.state import optimizers

    states = [t for o in optimizers(eng.optimizer) for st in getattr(o.optimizer, "state", {}).values()
              for t in (st.values() if isinstance(st, dict) else []) if torch.is_tensor(t)]
    assert states and all(t.device.type == "cpu" for t in states)
