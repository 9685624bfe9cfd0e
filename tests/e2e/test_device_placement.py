"""Placement on accelerator clusters, with Ray's logical accelerators (no device here).

A Ray node started with ``num_gpus=4`` / ``resources={"NPU": 4}`` assigns device ids and sets
``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` in each actor's process exactly as it does
on a real node. The driver's own placement code (``driver.place_workers``) places real
:class:`Worker` actors; each must see one device and bind local index 0, which is what vLLM's
external launcher and vllm-ascend use as ``{device}:{LOCAL_RANK}``.
"""
import pytest

from rlrecipes.recipe import load_recipe

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def logical_cluster():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, num_gpus=4, resources={"NPU": 4}, include_dashboard=False,
             log_to_driver=False, configure_logging=False, namespace="rlrecipes-placement-test")
    yield
    ray.shutdown()


@pytest.mark.parametrize("device_type, env_name", [("cuda", "CUDA_VISIBLE_DEVICES"), ("npu", "ASCEND_RT_VISIBLE_DEVICES")])
def test_each_worker_sees_one_device_and_binds_index_0(logical_cluster, tmp_path, device_type, env_name):
    import ray

    from rlrecipes.workflow.driver import place_workers

    recipe = load_recipe("qwen25_7b", smoke=True,
                         overrides=[f"resources.device={device_type}", "resources.cpus_per_worker=0.5"])
    pg, workers = place_workers(recipe, 4, device_type, tmp_path, [], None)
    try:
        seen = ray.get([w.binding.remote() for w in workers], timeout=120)
    finally:
        for w in workers:
            ray.kill(w)
        ray.util.remove_placement_group(pg)
    assert [b["rank"] for b in seen] == [0, 1, 2, 3]
    for b in seen:
        assert b["device_type"] == device_type
        assert len(b["assigned"]) == 1, b
        assert b["visible"] == b["assigned"][0], f"{env_name} should name only the assigned device: {b}"
        assert b["local_rank"] == 0, b
    assert sorted(b["assigned"][0] for b in seen) == ["0", "1", "2", "3"]  # four different devices


def test_missing_npu_runtime_is_refused_before_anything_is_placed(logical_cluster, tmp_path):
    """The cluster advertises NPUs, but torch_npu is not installed: the run stops before placement
    with what to install, and no placement group or worker is left behind."""
    import ray

    from rlrecipes.cluster import ClusterError
    from rlrecipes.plan import build_plan
    from rlrecipes.workflow.driver import run_recipe

    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    recipe = load_recipe("qwen25_7b", smoke=True, overrides=["resources.device=npu", "resources.cpus_per_worker=0.5",
                                                            "resources.devices_per_node=2"])
    plan = build_plan(recipe)
    before = len(ray.util.placement_group_table())
    with pytest.raises(ClusterError, match="torch_npu is not installed"):
        run_recipe(recipe, plan, lambda event: None, out=tmp_path / "run", embedded=False)
    assert len(ray.util.placement_group_table()) == before  # workers are only ever placed in a group
