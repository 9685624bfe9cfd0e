def pytest_runtest_teardown(item, nextitem):
    """The Ray session the e2e tests' in-process runs share (``inproc.py``) ends with the last e2e
    test, so the tests after them find no Ray in this process. (A package-scoped fixture would not
    do: tests/e2e is no package, so such a fixture lives to the end of the whole session.)"""
    here = item.path.parent
    if nextitem is None or nextitem.path.parent != here:
        from inproc import shutdown_ray

        shutdown_ray()
