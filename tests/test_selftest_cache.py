"""The kernels' load-time self-test is remembered on disk once passed (issue 20): a second load skips it;
a failure is never remembered; a damaged cache file is one line (an error under SPARSEKIT_STRICT=1).
The GPU is faked: the prerequisites pass and ``health.self_test`` is a stand-in that counts its calls."""
from __future__ import annotations

import json

import pytest
import torch

from sparsekit.errors import SparsekitError, SparsekitWarning
from sparsekit.kernels import health
from sparsekit.runtime import selftest_cache

IDENT = [selftest_cache.VERSION, "NVIDIA H100 80GB HBM3", "9.0", "2.13.0", "0.62", "0.30.4", "0.1.0", "abc", "default"]


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A GPU whose self-test passes (``calls`` counts the runs); the cache root in ``tmp_path``."""
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(health, "prerequisites", lambda: health.KernelStatus(True, "ready", None, "0.30.4"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    ident = list(IDENT)
    monkeypatch.setattr(selftest_cache, "identity", lambda: list(ident))
    calls = []
    outcome = {"fail": None}

    def self_test():
        calls.append(1)
        if outcome["fail"]:
            raise RuntimeError(outcome["fail"])

    monkeypatch.setattr(health, "self_test", self_test)
    return calls, outcome, ident


def cache_files(tmp_path):
    return sorted((tmp_path / "cache" / "selftest").glob("*.json"))


def test_a_pass_is_remembered_and_the_second_load_skips_the_test(fake_gpu, tmp_path):
    calls, _, _ = fake_gpu
    first = selftest_cache.kernel_status()
    assert first.ok and len(calls) == 1 and "cached" not in first.line
    [path] = cache_files(tmp_path)
    assert path == selftest_cache.cache_file(IDENT)
    assert json.loads(path.read_text())["entries"]["self_test"] == {"passed": True, "identity": IDENT}
    second = selftest_cache.kernel_status()
    assert second.ok and len(calls) == 1 and "self-test passed before, cached" in second.line
    assert second.numba_cuda == "0.30.4"


def test_another_gpu_software_or_kernel_variant_tests_again(fake_gpu, tmp_path):
    calls, _, ident = fake_gpu
    selftest_cache.kernel_status()
    for i, value in ((1, "NVIDIA A100-SXM4-80GB"), (2, "8.0"), (5, "0.31.0"), (8, "v3")):
        ident[:] = IDENT
        ident[i] = value
        assert selftest_cache.kernel_status().ok
    assert len(calls) == 5 and len(cache_files(tmp_path)) == 5
    assert len({str(selftest_cache.cache_file(i)) for i in (IDENT, [*IDENT[:8], "v3"])}) == 2


def test_a_failed_self_test_is_never_cached(fake_gpu, tmp_path):
    calls, outcome, _ = fake_gpu
    outcome["fail"] = "compile error\nmore"
    for n in (1, 2):
        st = selftest_cache.kernel_status()
        assert not st.ok and "RuntimeError: compile error" in st.line and len(calls) == n
    assert cache_files(tmp_path) == []
    outcome["fail"] = None
    assert selftest_cache.kernel_status().ok and len(calls) == 3 and len(cache_files(tmp_path)) == 1


def test_a_record_that_did_not_pass_runs_the_test(fake_gpu):
    calls, outcome, _ = fake_gpu
    path = selftest_cache.cache_file(IDENT)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "entries": {"self_test": {"passed": False, "identity": IDENT}}}))
    outcome["fail"] = "broken"
    assert not selftest_cache.kernel_status().ok and len(calls) == 1
    assert json.loads(path.read_text())["entries"]["self_test"]["passed"] is False   # not overwritten as passed


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "entries": {}}),
                                     json.dumps({"version": 1, "entries": {"self_test": "yes"}})])
def test_a_damaged_cache_file_is_one_line_and_an_error_when_strict(fake_gpu, monkeypatch, content):
    calls, _, _ = fake_gpu
    path = selftest_cache.cache_file(IDENT)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    monkeypatch.setenv("SPARSEKIT_STRICT", "1")
    with pytest.raises(SparsekitError, match="self-test cache .* cannot be used .*SPARSEKIT_STRICT"):
        selftest_cache.kernel_status()
    assert calls == []
    monkeypatch.setenv("SPARSEKIT_STRICT", "0")
    with pytest.warns(SparsekitWarning, match="cannot be used .*running the self-test again") as got:
        assert selftest_cache.kernel_status().ok
    assert len(got) == 1 and "\n" not in str(got[0].message) and len(calls) == 1
    assert json.loads(path.read_text())["entries"]["self_test"]["passed"] is True   # rewritten
    monkeypatch.setenv("SPARSEKIT_STRICT", "1")
    assert selftest_cache.kernel_status().ok and len(calls) == 1


def test_an_unwritable_cache_is_said_and_the_status_still_ok(fake_gpu, monkeypatch, tmp_path):
    calls, _, _ = fake_gpu
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("SPARSEKIT_CACHE", str(blocked))
    with pytest.warns(SparsekitWarning, match="could not be cached"):
        assert selftest_cache.kernel_status().ok
    assert len(calls) == 1


def test_failed_prerequisites_never_reach_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    st = selftest_cache.kernel_status()
    assert not st.ok and "simulator" in st.line and not (tmp_path / "cache").exists()
