"""A process already joined to Ray (here: the e2e tests' shared session) runs on that cluster only."""
import pytest

from inproc import ensure_ray, invoke


@pytest.mark.e2e
def test_a_joined_process_refuses_another_clusters_address():
    import ray

    from rlrecipes.cluster import ClusterError, connect

    ensure_ray()
    joined = ray.get_runtime_context().gcs_address
    assert connect() == "existing" and connect("auto") == "existing" and connect(joined) == "existing"
    host, port = joined.rsplit(":", 1)
    assert connect(f"localhost:{port}") == "existing"  # the same head, spelled by name
    with pytest.raises(ClusterError, match="already joined to the Ray cluster at"):
        connect("127.0.0.1:9")
    out = invoke("run", "qwen25_7b", "--smoke", "--address", "127.0.0.1:9")
    assert out.returncode == 2 and "already joined" in out.stdout + out.stderr, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
