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


@pytest.mark.parametrize("argv", [["--ns", "a"], ["--form", "sp24", "--kind", "0.5"], ["--kind", "2:4,0.5"],
                                  ["--calls", "0"]])
def test_probe_eager_bad_input_exits_2_before_looking_for_a_gpu(argv):
    r = subprocess.run([sys.executable, "-m", "scripts.bench.probe_eager", *argv], capture_output=True, text=True)
    assert r.returncode == 2 and "GPU" not in r.stderr and "error:" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("form", ["sp24", "tcabme"])
def test_probe_eager_layers_compute_the_weight_they_were_given(form):
    """The probed layer is the weight itself in the form asked for (the 2:4 form keeps no TCA-BME buffers)."""
    import torch

    from scripts.bench.probe_eager import layer_of
    from scripts.common import masked_weight

    w = masked_weight(128, 256, "2:4", torch.Generator().manual_seed(0), device="cpu")
    layer = layer_of(w, form)
    assert layer.sp24_only == (form == "sp24")
    x = torch.randn(5, 256).half()
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w))
