"""scripts/bench/probe_attention.py: its input checks, which come before it looks for a GPU (no GPU needed)."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv", [["--kv-heads", "5"], ["--lens", "0"], ["--cache", "-1"], ["--backends", "flash"],
                                  ["--batch-sizes", "a"], ["--head-dim", "0"]])
def test_bad_input_exits_2_before_looking_for_a_gpu(argv):
    r = subprocess.run([sys.executable, "-m", "scripts.bench.probe_attention", *argv], capture_output=True, text=True)
    assert r.returncode == 2 and "GPU" not in r.stderr and "error:" in r.stderr.strip().splitlines()[-1]


def test_good_input_without_a_gpu_says_so_in_one_line_and_exits_2():
    r = subprocess.run([sys.executable, "-m", "scripts.bench.probe_attention", "--kv-heads", "8"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == "the attention probe runs on a CUDA GPU"
