"""The start-up space check of encode and export-bitmask estimates the output within about 10%
(issue 25 item 9: both estimated the dense size, 269 MB where the output was 177 MB, so a 200 MB
disk was refused although the output would have fit)."""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparsekit.errors import SparsekitError
from sparsekit.packed.encoding import encode
from sparsekit.packed.interchange import export_bitmask
from tiny_models import save_tiny, write_corpus

WRITERS = {"encode": encode, "export-bitmask": export_bitmask}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A 50% Wanda-pruned tiny Llama (what `sparsekit prune` writes, sparsekit.json included), its
    packed form, and the sizes of every output made from them."""
    from sparsekit.pruning.api import prune

    d = tmp_path_factory.mktemp("estimate")
    save_tiny("llama", d / "base")
    prune(str(d / "base"), method="wanda", sparsity=0.5, calib=str(write_corpus(d / "calib.txt")), nsamples=4,
          seqlen=32, device="cpu", output=d / "pruned", warn=lambda m: None)
    encode(d / "pruned", d / "packed")
    return d


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(total=10**12, used=10**12 - free, free=free))


@pytest.mark.parametrize("writer, source", [("encode", "pruned"), ("export-bitmask", "pruned"),
                                            ("export-bitmask", "packed")])
def test_the_space_check_estimates_the_output_within_ten_percent(sources, tmp_path, monkeypatch, writer, source):
    run = WRITERS[writer]
    actual = _size(run(sources / source, tmp_path / "real")["output"] and tmp_path / "real")
    _free(monkeypatch, int(actual * 1.10))    # room for the output and a little more: it runs
    run(sources / source, tmp_path / "fits")
    assert _size(tmp_path / "fits") == actual
    _free(monkeypatch, int(actual * 0.90))    # less room than the output takes: refused before any work
    with pytest.raises(SparsekitError, match="not enough space"):
        run(sources / source, tmp_path / "too-big")
    assert not (tmp_path / "too-big").exists()
