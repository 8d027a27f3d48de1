"""The shared-memory opt-in of directly launched kernels (``kernels.launch.direct_ready``): it belongs to the
function launched, not to the numba dispatcher. A second process with a warm kernel cache launched a cubin
loaded from disk after numba's path had opted in only its own compiled function, and failed with
CUDA_ERROR_INVALID_VALUE (7B-shaped model, H100, session 15)."""
from __future__ import annotations

import torch

from sparsekit.kernels import compat_numba, launch, plan


def test_a_direct_launch_opts_its_own_function_in(monkeypatch):
    calls = []
    monkeypatch.setattr(compat_numba, "set_max_dyn_smem", lambda ck, nb, dev: calls.append((ck, nb)) or True)
    monkeypatch.setattr(launch, "optin_bytes", {})
    monkeypatch.setattr(launch, "optin_done", {1})       # the dispatcher took numba's opt-in: not the cubin's
    dev = torch.device("cpu")
    fkey = (1, None)
    assert launch.direct_ready(fkey, "cubin", 40 * 1024, dev) and calls == []        # under 47 KB: none needed
    assert launch.direct_ready(fkey, "cubin", 100 * 1024, dev)
    assert calls == [("cubin", plan.WARP_SMEM_MAX)]
    assert launch.direct_ready(fkey, "cubin", 120 * 1024, dev) and len(calls) == 1   # already enough
    assert launch.direct_ready(fkey, "cubin", 200 * 1024, dev) and calls[-1] == ("cubin", 200 * 1024)


def test_a_refused_opt_in_sends_the_launch_through_numba(monkeypatch):
    monkeypatch.setattr(compat_numba, "set_max_dyn_smem", lambda *a: False)
    monkeypatch.setattr(launch, "optin_bytes", {})
    assert launch.direct_ready((2, None), "cubin", 30 * 1024, torch.device("cpu"))
    assert not launch.direct_ready((2, None), "cubin", 100 * 1024, torch.device("cpu"))
