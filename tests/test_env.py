"""sparsekit env and the kernel health check: one line saying whether the kernels can run, and the fix."""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.kernels import health


def fake_numba_cuda(monkeypatch, **attrs):
    """Make ``from numba import cuda`` give a stand-in, whether or not numba.cuda was imported before."""
    import numba

    ns = types.SimpleNamespace(**attrs)
    monkeypatch.setitem(sys.modules, "numba.cuda", ns)
    monkeypatch.setattr(numba, "cuda", ns, raising=False)


@pytest.fixture
def fresh_status():
    health.kernel_status.cache_clear()
    yield
    health.kernel_status.cache_clear()


def test_env_json_reports_versions_and_kernels(fresh_status, monkeypatch):
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    res = CliRunner().invoke(app, ["env", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert torch.__version__.startswith(rep["packages"]["torch"].split("+")[0])
    assert rep["kernels"]["line"].startswith("kernels: ")
    if not torch.cuda.is_available():
        assert rep["kernels"]["ok"] is False and "no CUDA GPU" in rep["kernels"]["line"]


def test_env_table_prints_the_kernel_line(fresh_status, monkeypatch):
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    res = CliRunner().invoke(app, ["env"])
    assert res.exit_code == 0 and "kernels: " in res.stdout and "GPU: " in res.stdout


def test_builtin_numba_cuda_target_is_refused_with_the_install_line(fresh_status, monkeypatch):
    """A GPU, but numba's built-in CUDA target (no numba-cuda): not ok, and the line says what to install."""
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(health, "numba_cuda_version", lambda: None)
    fake_numba_cuda(monkeypatch, implementation="Built-in")
    st = health.kernel_status()
    assert not st.ok
    assert 'pip install "sparsekit[gpu]"' in st.line and "numba-cuda[cu13]" in st.fix


def test_cuda12_torch_gets_the_cu12_extra(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert 'sparsekit[gpu-cu12]' in health.install_hint() and "numba-cuda[cu12]" in health.install_hint()


def test_a_kernel_that_fails_to_compile_is_caught_at_the_check(fresh_status, monkeypatch):
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(health, "numba_cuda_version", lambda: "0.30.4")
    fake_numba_cuda(monkeypatch, implementation="NVIDIA", is_available=lambda: True)

    def broken():
        raise TypeError("Failed in cuda mode pipeline (step: nopython frontend)\nmore lines")

    monkeypatch.setattr(health, "self_test", broken)
    st = health.kernel_status()
    assert not st.ok and "TypeError: Failed in cuda mode pipeline" in st.line and "\n" not in st.line


def test_simulator_is_never_reported_usable(fresh_status, monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert not health.kernel_status().ok


def test_installed_but_inactive_numba_cuda_is_named_as_such(fresh_status, monkeypatch):
    """numba-cuda's files are there but its import redirector never ran: numba.cuda is the built-in target."""
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(health, "numba_cuda_version", lambda: "0.30.4")
    fake_numba_cuda(monkeypatch, implementation="Built-in")
    st = health.kernel_status()
    assert not st.ok and "0.30.4 is installed but inactive" in st.line


def test_error_lines_keep_square_brackets():
    """rich markup must not eat the extra in 'pip install "sparsekit[gpu]"' (or any [..] in an error)."""
    import typer

    from sparsekit.cli.common import handle_errors
    from sparsekit.errors import SparsekitError

    app = typer.Typer()

    @app.command()
    @handle_errors
    def fail():
        raise SparsekitError('needs the kernels: pip install "sparsekit[gpu]"')

    res = CliRunner().invoke(app, [])
    assert res.exit_code == 2 and 'sparsekit[gpu]' in res.output


def test_env_names_the_gpu_memory_rate_and_the_plan_set_it_takes(fresh_status, monkeypatch):
    """An H200 (4.8 TB/s) takes the 2:4 plans measured on fast memory, and ``sparsekit env`` says so."""
    from types import SimpleNamespace

    from sparsekit.evaluation import environment
    from sparsekit.kernels import gpu_facts

    monkeypatch.delenv("SPARSEKIT_FAST_MEMORY", raising=False)
    monkeypatch.setattr(gpu_facts, "SIM", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 7)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(memory_clock_rate=3_201_000, memory_bus_width=6016))
    monkeypatch.setattr(health, "kernel_status", lambda: health.KernelStatus(True, "kernels: ok (fake)", ""))
    rep = environment.environment_report()
    assert rep["gpu_memory"] == {"gbps": 4814, "fast_memory_plans": True}
    res = CliRunner().invoke(app, ["env"])
    assert res.exit_code == 0 and "GPU memory: 4814 GB/s; 2:4 kernels take the fast-memory" in res.stdout
    monkeypatch.setenv("SPARSEKIT_FAST_MEMORY", "0")
    assert environment.environment_report()["gpu_memory"]["fast_memory_plans"] is False
