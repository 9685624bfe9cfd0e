"""How a worker reserves and binds its device (rlrecipes/device.py), against Ray's own option rules.

Ray 2.60 refuses ``resources={"GPU": n}`` in actor options; ``device.ray_actor_options`` must pass
Ray's validator for every device type. ``bound_device_index`` maps Ray's assigned id to the index
inside the process's visible devices (0 when Ray narrowed them, which it does by default)."""
import pytest
from ray._common.ray_option_utils import validate_actor_options

from rlrecipes import device as dev


def test_ray_rejects_gpu_in_resources_which_is_why_num_gpus_is_used():
    with pytest.raises(ValueError, match="num_gpus"):
        validate_actor_options({"num_cpus": 1, "resources": {"GPU": 1}}, in_options=True)


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "npu"])
def test_actor_options_pass_rays_validator(device_type):
    opts = {"num_cpus": 1, **dev.ray_actor_options(device_type)}
    validate_actor_options(opts, in_options=True)  # raises on a key Ray refuses
    if device_type == "cuda":
        assert opts["num_gpus"] == 1
    elif device_type == "npu":
        assert opts["resources"] == {"NPU": 1}
    else:
        assert set(opts) == {"num_cpus"}


@pytest.mark.parametrize("device_type, env", [("cuda", "CUDA_VISIBLE_DEVICES"), ("npu", "ASCEND_RT_VISIBLE_DEVICES")])
def test_bound_index(device_type, env):
    # Ray narrowed the visible devices to the assigned one: index 0, whatever the physical id
    assert dev.bound_device_index(device_type, ["5"], {env: "5"}) == 0
    # every device kept visible (RAY_EXPERIMENTAL_NOSET_*): the position of the assigned id
    assert dev.bound_device_index(device_type, ["5"], {env: "4,5,6,7"}) == 1
    assert dev.bound_device_index(device_type, ["3"], {}) == 3
    with pytest.raises(RuntimeError, match="does not include device 2"):
        dev.bound_device_index(device_type, ["2"], {env: "0,1"})
    with pytest.raises(RuntimeError, match="exactly one"):
        dev.bound_device_index(device_type, ["0", "1"], {env: "0,1"})
    assert dev.bound_device_index(device_type, [], {env: "3"}) == 0  # not under Ray: the first visible device


def test_cpu_binds_nothing():
    assert dev.bound_device_index("cpu", [], {}) == 0


def test_runtime_problem_names_what_to_install():
    import importlib.util

    import torch

    if importlib.util.find_spec("torch_npu") is None:
        assert "torch_npu" in dev.runtime_problem("npu")
    if torch.version.cuda is None:
        assert "neither a CUDA nor a ROCm build" in dev.runtime_problem("cuda")
    assert dev.runtime_problem("cpu") is None
