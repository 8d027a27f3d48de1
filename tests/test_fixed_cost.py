"""scripts/bench/fixed_cost.py: the line it fits through a kernel's times, and its input checks (no GPU needed)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from scripts.bench.fixed_cost import fit


def test_the_fit_recovers_a_fixed_cost_and_a_rate():
    nbytes = [8e6, 16e6, 33e6, 67e6]
    times = [6.4 + b / 4400e3 for b in nbytes]            # 6.4 us + bytes at 4400 GB/s (4.4e3 bytes an ns)
    t0, rate, worst = fit(nbytes, times)
    assert t0 == pytest.approx(6.4, abs=1e-6) and rate == pytest.approx(4400, rel=1e-6) and worst < 1e-9
    t0, rate, worst = fit(nbytes, [t * (1.1 if i == 2 else 1.0) for i, t in enumerate(times)])
    assert worst > 0.03                                     # one point 10% off shows in the residual


def test_a_flat_time_has_no_finite_rate_and_one_point_is_no_fit():
    assert fit([1e6, 2e6], [5.0, 5.0])[:2] == (pytest.approx(5.0), float("inf"))
    with pytest.raises(ValueError):
        fit([1e6, 1e6], [5.0, 6.0])


@pytest.mark.parametrize("argv", [["--share", "2"], ["--ks", "4096"], ["--kernels", "cublas,fast"], ["--ns", "a"],
                                  ["--ms", "0"]])
def test_bad_input_exits_2_before_looking_for_a_gpu(argv):
    r = subprocess.run([sys.executable, "-m", "scripts.bench.fixed_cost", *argv], capture_output=True, text=True)
    assert r.returncode == 2 and "GPU" not in r.stderr and "error:" in r.stderr.strip().splitlines()[-1]
