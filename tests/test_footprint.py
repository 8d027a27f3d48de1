"""The suite's disk footprint (issue 25 item 13: it left 656 MB in pytest's base temporary folder,
and pytest keeps the last three runs). A passing test's ``tmp_path`` is removed when it ends, and a
run that passes leaves no temporary folder (``tmp_path_retention_policy = "failed"``); a failing test
keeps its folder to look at."""
from __future__ import annotations

from pathlib import Path

import pytest

_seen: list[Path] = []


def test_a_passing_test_writes_into_its_tmp_path(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"0" * 1000)
    _seen.append(tmp_path)


def test_its_folder_is_gone_once_it_passed():
    if not _seen:
        pytest.skip("runs after the test above (file order)")
    assert not _seen[0].exists()
