"""MoE rollout routing replay (R3): the actor's training forward routes every recorded token to
exactly the experts the rollout used, even where the trainer's router would choose others."""

import pytest
import torch

from rlrecipes.engines.base import SamplingParams, SeqBatch
from rlrecipes.engines.native.batching import padded_micro_batch
from rlrecipes.engines.native.rollout import NativeRolloutEngine
from rlrecipes.engines.native.routing import gate_weights, per_sample_routing
from rlrecipes.engines.native.train import NativeTrainEngine
from rlrecipes.models import SMOKE


pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def test_per_sample_assembly_by_hand():
    # B=2, P=3 (sample 0 has 2 prompt tokens, sample 1 has 3), 2 layers, k=1; two decode steps.
    # Layer 1 ran the prefill on the last prompt position only.
    col = lambda *v: torch.tensor(v, dtype=torch.int32)[:, None]  # noqa: E731
    layer0 = [col(9, 1, 2, 3, 4, 5), col(6, 7), col(8, 0)]
    layer1 = [col(20, 50), col(60, 70), col(80, 0)]
    got = per_sample_routing([layer0, layer1], prompt_lens=[2, 3], padded_prompt_len=3, response_lens=[3, 1])
    assert got[0][:, 0, 0].tolist() == [1, 2, 6, 8, -1]  # left pad skipped; last response token unset
    assert got[0][:, 1, 0].tolist() == [-1, 20, 60, 80, -1]
    assert got[1][:, 0, 0].tolist() == [3, 4, 5, -1] and got[1][:, 1, 0].tolist() == [-1, -1, 50, -1]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_training_forward_uses_exactly_the_rollout_experts(family):
    dims = SMOKE[family]
    roll = NativeRolloutEngine(dims, device="cpu", seed=0, dtype="fp32")
    roll.record_routing()
    prompts = [torch.tensor([3, 1, 4]), torch.tensor([1, 5, 9, 2, 6])]
    out = roll.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0), seed=1)
    routed = out.routed_experts
    assert [r.shape[0] for r in routed] == [p.numel() + x.numel() for p, x in zip(prompts, out.responses)]

    train = NativeTrainEngine(dims, role="actor", layout=(1, 1), device="cpu", seed=0, dtype="fp32")
    train.replay_routing()
    with torch.no_grad():  # a different router: left alone it would route (some) tokens elsewhere
        for r in train.routing.routers:
            r.weight.add_(torch.randn_like(r.weight))
    batch = SeqBatch(prompts, out.responses, routed_experts=routed)
    mb = padded_micro_batch(batch, pad_id=0)
    T = mb["input_ids"].shape[1]
    want = mb["routed_experts"]  # [b, T, layers, k]

    # the experts each router's output ends with, after the replay hook (registered later, so it runs after)
    seen = [torch.empty(0) for _ in train.routing.routers]
    for i, r in enumerate(train.routing.routers):
        r.register_forward_hook(lambda _m, _a, out, i=i: seen.__setitem__(i, out[2].detach()))

    def used():
        return torch.stack([u.reshape(2, T, -1) for u in seen], dim=2)  # [b, T, layers, k]

    free = {k: v for k, v in mb.items() if k != "routed_experts"}
    train._forward(free)
    natural = used()
    train._forward(mb)
    replayed = used()
    rec = want[..., 0] >= 0  # [b, T, layers]
    assert torch.equal(replayed[rec], want[rec]), "replayed routing differs from the rollout's"
    assert not torch.equal(natural[rec], want[rec]), "the perturbed router should have routed some tokens elsewhere"
    # unrecorded tokens keep the router's own choice (first MoE layer: nothing replayed upstream of it)
    assert torch.equal(replayed[:, :, 0][~rec[:, :, 0]], natural[:, :, 0][~rec[:, :, 0]])


def test_replayed_gate_weights_are_the_routers_own_at_those_experts():
    from transformers import AutoModelForCausalLM

    from rlrecipes.models import hf_config
    from rlrecipes.engines.native.routing import routers

    model = AutoModelForCausalLM.from_config(hf_config(SMOKE["qwen3_moe"]))
    r = routers(model)[0]
    torch.nn.init.normal_(r.weight)
    h = torch.randn(4, SMOKE["qwen3_moe"].hidden_size)
    logits, w, idx = r(h)
    assert torch.allclose(gate_weights(r, logits, idx), w, atol=1e-6)  # same experts -> same weights
