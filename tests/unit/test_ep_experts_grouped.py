"""EPExperts' grouped-GEMM path (``grouped_mm=True``, issue 49) computes what its per-expert loop
computes: the same outputs and the same gradients for the hidden states and both weight tensors,
with experts that no token hits. (The engine passes ``moe_grouped_mm`` to EPExperts, which only
an EP > 1 layout builds.)"""
import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def _experts(grouped: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from rlrecipes.engines.native.parallel import EPExperts
    from rlrecipes.models import SMOKE
    from rlrecipes.models.catalog import hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(SMOKE["qwen3_moe"])).float()
    experts = model.model.layers[0].mlp.experts
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    return EPExperts(experts, mesh, grouped_mm=grouped)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM")
def test_grouped_experts_equal_the_per_expert_loop_forward_and_backward():
    loop, grouped = _experts(False), _experts(True)
    assert grouped.grouped_mm and not loop.grouped_mm
    g = torch.Generator().manual_seed(1)
    n, k, H = 40, 2, loop.gate_up_proj.shape[-1]
    x = torch.randn(n, H, generator=g)
    idx = torch.randint(0, loop.num_experts - 2, (n, k), generator=g)  # the last two experts get no token
    w = torch.rand(n, k, generator=g)
    target = torch.randn(n, H, generator=g)
    outs, grads = [], []
    for mod in (loop, grouped):
        xi = x.clone().requires_grad_(True)
        out = mod(xi, idx, w)
        (out * target).sum().backward()
        outs.append(out.detach())
        grads.append((xi.grad, mod.gate_up_proj.grad.to_local(), mod.down_proj.grad.to_local()))
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert grads[1][1][-2:].abs().sum() == 0  # experts no token hit get no gradient

