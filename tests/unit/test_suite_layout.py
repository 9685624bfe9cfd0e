"""The test command collects every test folder (pytest skips folders matching ``norecursedirs``,
whose default includes ``dist``)."""
from __future__ import annotations

import fnmatch
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_test_folder_is_left_out_of_collection(pytestconfig):
    skipped = pytestconfig.getini("norecursedirs")
    folders = [d for d in os.listdir(TESTS) if os.path.isdir(os.path.join(TESTS, d)) and d != "__pycache__"]
    assert "dist" in folders
    assert not [d for d in folders if any(fnmatch.fnmatch(d, p) for p in skipped)], skipped
