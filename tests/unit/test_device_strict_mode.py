"""The device-strict mode's own rules (rlrecipes.device_strict): what CUDA refuses raises, what it
accepts runs, and the simulated device reads like one to the rest of rlrecipes."""
import pytest
import torch

from rlrecipes import device as dev
from rlrecipes import device_strict
from rlrecipes.device_strict import DeviceMixError, DeviceTensor


@pytest.fixture
def device():
    with device_strict.simulate("cuda") as d:
        yield d


def test_the_simulated_device_reads_like_a_cuda_device(device):
    assert dev.resolve("cuda") == "cuda" and dev.detect() == "cuda"
    assert dev.torch_device("cuda") == device and device.type != "cpu"
    assert dev.comm_backend("cuda") == "gloo" and dev.runtime_problem("cuda") is None
    assert dev.train_dtype(device) == torch.float32  # the host computes
    assert dev.mesh_device_type(device.type) == "cpu"
    assert device_strict.active()


def test_leaving_the_block_restores_the_host():
    with device_strict.simulate("cuda"):
        pass
    assert dev.simulated() is None and not device_strict.active()
    assert dev.detect() == "cpu"
    assert not torch.__future__.get_swap_module_params_on_conversion()


@pytest.mark.parametrize("op", [
    lambda d, h: h + d,
    lambda d, h: torch.cat([d, h]),
    lambda d, h: torch.where(d > 0, d, h),
    lambda d, h: h.add_(d),
    lambda d, h: h.index_put_((torch.tensor([0, 1]),), d[:2]),
])
def test_what_cuda_refuses_raises(device, op):
    d, h = torch.randn(4, device=device), torch.randn(4)
    with pytest.raises(DeviceMixError, match="Expected all tensors to be on the same device"):
        op(d, h)


def test_what_cuda_accepts_runs_with_host_values(device):
    d = torch.arange(6.0).to(device)
    assert (d * torch.tensor(2.0)).device == device            # a 0-dim host tensor is a scalar
    assert torch.equal(d[torch.tensor([0, 5])].cpu(), torch.tensor([0.0, 5.0]))  # host indices
    d[torch.tensor([True, False, True, False, False, False])] = 7.0
    assert d.tolist() == [7.0, 1.0, 7.0, 3.0, 4.0, 5.0]
    h = torch.zeros(6)
    h.copy_(d)                                                  # copies cross devices
    assert h.device.type == "cpu" and h.tolist() == d.tolist()
    assert d.cpu().device.type == "cpu" and not isinstance(d.cpu(), DeviceTensor)
    assert float(d.sum()) == 27.0


def test_in_place_ops_and_autograd_keep_the_device(device):
    lin = torch.nn.Linear(4, 3).to(device)
    assert isinstance(lin.weight, DeviceTensor) and isinstance(lin.weight, torch.nn.Parameter)
    x = torch.randn(2, 4, device=device)
    y = x.mul_(2)
    assert y is x
    lin(x).sum().backward()
    assert lin.weight.grad.device == device
    with pytest.raises(DeviceMixError):
        lin(torch.randn(2, 4))  # a host input to a model on the device


def test_the_error_names_the_line_and_where_the_device_tensor_came_from(device):
    column = "ref_log_probs"  # noqa: F841 (the origin reads the column from the frame that moved it)
    rows = torch.randn(3).to(device)
    out = torch.zeros(2, 2)
    with pytest.raises(DeviceMixError) as e:
        out[torch.tensor([[True, True], [True, False]])] = rows
    msg = str(e.value)
    assert "index_put_" in msg and "values is on" in msg and "(simulated cuda)" in msg
    assert "self on cpu" in msg and "on the device since outside rlrecipes" in msg


def test_only_cuda_is_simulated():
    with pytest.raises(ValueError, match="cuda or npu"):
        dev._set_simulated("cpu")
