"""The argument parsing of the GPU-only probe scripts, which CI can run without a GPU."""
from __future__ import annotations

import subprocess
import sys

import pytest

from scripts.bench.probe_prefill_ncu import plans_arg


def test_plans_parse_own_and_forced_plans_in_order():
    assert plans_arg("own;cluster=2;tokens=256,stages=3") == [{}, {"cluster": 2}, {"tokens": 256, "stages": 3}]
    assert plans_arg("") == [{}]


@pytest.mark.parametrize("bad", ["x=y", "tokens", "tokens=1.5"])
def test_a_bad_plan_is_one_line_and_exit_2(bad, capsys):
    with pytest.raises(SystemExit) as e:
        plans_arg(bad)
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["--shape", "12"], ["--ns", "a"], ["--plans", "x=y"]])
def test_bad_input_exits_2_before_looking_for_a_gpu(argv):
    r = subprocess.run([sys.executable, "-m", "scripts.bench.probe_prefill_ncu", *argv], capture_output=True, text=True)
    assert r.returncode == 2 and "GPU" not in r.stderr
