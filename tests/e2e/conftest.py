import pytest


@pytest.fixture(scope="package", autouse=True)
def _shared_ray_ends_with_the_e2e_tests():
    """The Ray session the e2e tests' in-process runs share (``inproc.py``) ends with them."""
    yield
    from inproc import shutdown_ray

    shutdown_ray()
