"""The on-disk kernel cache (kernels/kcache.py): what its file names depend on, and how it stores and
reads cubins. Loading a cubin into a GPU process is checked by scripts/checks/gpu_kcache.py."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from sparsekit.errors import SparsekitError
from sparsekit.kernels import kcache


class _Kernel:
    """Stands in for a numba dispatcher: a ``py_func`` from this module, and attributes settable."""

    def __init__(self):
        def kernel(x):
            return x

        self.py_func = kernel


BLOCK = 4          # a module constant: part of every tagged key of this module


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path))
    return tmp_path


ARGS = (np.zeros(4, np.int64), np.zeros(4, np.int16), 7, 8)


def test_untagged_kernels_are_not_cached():
    assert kcache.key_of(_Kernel(), ARGS, (9, 0)) is None


def test_key_depends_on_tag_args_capability_and_module_constants(monkeypatch):
    k = kcache.tag(_Kernel(), "spmm_warp", (1, 3, 2))
    base = kcache.key_of(k, ARGS, (9, 0))
    assert base == kcache.key_of(kcache.tag(_Kernel(), "spmm_warp", (1, 3, 2)), ARGS, (9, 0))
    others = [
        kcache.key_of(kcache.tag(_Kernel(), "spmm_warp", (1, 3, 3)), ARGS, (9, 0)),     # build key
        kcache.key_of(kcache.tag(_Kernel(), "spmm_rows", (1, 3, 2)), ARGS, (9, 0)),     # factory
        kcache.key_of(k, ARGS, (8, 9)),                                                  # GPU
        kcache.key_of(k, (np.zeros(4, np.int32),) + ARGS[1:], (9, 0)),                   # argument types
    ]
    monkeypatch.setattr(sys.modules[__name__], "BLOCK", 8)
    others.append(kcache.key_of(kcache.tag(_Kernel(), "spmm_warp", (1, 3, 2)), ARGS, (9, 0)))
    monkeypatch.setenv("NUMBA_OPT", "1")
    others.append(kcache.key_of(k, ARGS, (9, 0)))                                        # numba settings
    assert base not in others and len(set(others)) == len(others)


def test_torch_tensors_and_numpy_arrays_type_alike():
    torch = pytest.importorskip("torch")
    assert kcache.arg_signature((torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int16), 5)) == \
        kcache.arg_signature((np.zeros(3, np.int64), np.zeros(2, np.int16), 5)) == ["int64[1]", "int16[1]", "i8"]


def test_key_is_the_same_in_another_process():
    """numba's own cache key changes per process (the reason this cache exists); ours must not."""
    code = ("import numpy as np; from tests import test_kernel_cache as t; from sparsekit.kernels import kcache; "
            "print(kcache.key_of(kcache.tag(t._Kernel(), 'decode', ()), t.ARGS, (9, 0)))")
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)}
    assert len(keys) == 1 and len(keys.pop()) == 24


def test_source_hash_changes_with_a_kernel_source(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(kcache, "__file__", str(tmp_path / "kcache.py"))
    kcache.source_hash.cache_clear()
    try:
        h1 = kcache.source_hash()
        kcache.source_hash.cache_clear()
        (tmp_path / "a.py").write_text("x = 2\n")
        assert kcache.source_hash() != h1
    finally:
        kcache.source_hash.cache_clear()


def test_write_then_read_round_trips(root):
    assert kcache.read("abc") is None
    assert kcache.write("abc", b"\x7fELF-cubin", "_Z6kernel") is None
    assert kcache.read("abc") == (b"\x7fELF-cubin", "_Z6kernel")
    assert not [p for p in (root / "kernels").iterdir() if p.name.endswith(".tmp")]


def test_damaged_or_mismatched_files_are_refused(root):
    kcache.write("abc", b"cubin-bytes", "k")
    (root / "kernels" / "abc.cubin").write_bytes(b"cubin-byteZ")          # same length, other bytes
    with pytest.raises(ValueError, match="does not match"):
        kcache.read("abc")
    (root / "kernels" / "abc.json").write_text("{not json")
    with pytest.raises(ValueError):
        kcache.read("abc")
    (root / "kernels" / "abc.json").write_text(json.dumps({"version": 0, "entry": "k"}))
    with pytest.raises(ValueError, match="not a kernel cache file"):
        kcache.read("abc")


def test_unwritable_folder_is_reported_not_raised(root):
    (root / "kernels").write_text("a file where the folder should be")
    why = kcache.write("abc", b"x", "k")
    assert why and "Error" in why


@pytest.mark.parametrize("raw, on", [("", True), ("1", True), ("0", False)])
def test_switch(monkeypatch, raw, on):
    import warnings

    monkeypatch.setenv("SPARSEKIT_KERNEL_CACHE", raw)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert kcache.enabled() is on
        kcache.enabled()
    said = [str(w.message) for w in seen if "SPARSEKIT_KERNEL_CACHE" in str(w.message)]
    assert len(said) == (0 if on else 1)          # turning it off is said, once (only this test turns it off)


def test_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv("SPARSEKIT_KERNEL_CACHE", "yes")
    with pytest.raises(SparsekitError, match="SPARSEKIT_KERNEL_CACHE='yes'"):
        kcache.enabled()


def test_every_kernel_factory_tags_its_kernels():
    """A factory that forgets to tag loses the cache without a word: build one kernel of each."""
    from sparsekit.kernels import (cats_down, cats_up, decode, sp24_kernel, sp24_rows, sp24_wg, sp24_ws, spmm, spmm_rows,
                                   spmm_warp)

    built = {"spmm_warp": spmm_warp.get_kernel(1, 3, 2), "spmm_rows": spmm_rows.get_kernel(8, 3),
             "sp24_rows": sp24_rows.get_kernel(8, 3), "sp24_kernel": sp24_kernel.get_kernel(8, 1),
             "sp24_wg": sp24_wg.get_kernel(8, 3), "sp24_ws": sp24_ws.get_kernel(8, 3),
             "spmm": spmm.get_kernel(8, True, 2), "decode": decode.get_kernel(),
             "cats_up": cats_up.get_up(1, True), "cats_down": cats_down.get_down(1, True)}
    for name, k in built.items():
        assert json.loads(kcache.tag_of(k) or "[null]")[0] == name, name
        assert kcache.key_of(k, ARGS, (9, 0)) is not None, name
