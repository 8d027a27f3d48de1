"""``sparsekit.json`` as one typed model (issue 25 item 22): ``PruneMetadata`` with ``read``/``write``
and a schema version, the one place the file is read or written."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from sparsekit.hf.metadata import METADATA_FILE, SCHEMA_VERSION, PruneMetadata

from test_packing import make_pruned

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_written_then_read_gives_the_same_and_keeps_unknown_keys(tmp_path):
    meta = PruneMetadata(model="m", method="wanda", pattern="2:4", sparsity=0.5, skip=["lm_head"],
                         layers={"a.q": {"sparsity": 0.5, "shape": [8, 8], "kind": "linear"}},
                         cats={"target": 0.5, "mlps": {}}, extra={"from_a_later_tool": [1, 2]})
    meta.write(tmp_path)
    data = json.loads((tmp_path / METADATA_FILE).read_text())
    assert list(data)[0] == "schema_version" and data["schema_version"] == SCHEMA_VERSION
    assert data["from_a_later_tool"] == [1, 2] and "learning" not in data
    assert PruneMetadata.read(tmp_path) == meta
    assert PruneMetadata.read(tmp_path / "nowhere") is None


def test_a_file_from_before_the_schema_version_is_version_1(tmp_path):
    (tmp_path / METADATA_FILE).write_text(json.dumps({"model": "m", "method": "magnitude", "layers": {}}))
    meta = PruneMetadata.read(tmp_path)
    assert meta.schema_version == 1 and meta.model == "m" and meta.extra == {}


@pytest.mark.parametrize("content, message", [
    (json.dumps({"schema_version": SCHEMA_VERSION + 1}), "written by a newer sparsekit .* upgrade sparsekit"),
    (json.dumps({"schema_version": "one"}), "schema_version 'one' is not a positive integer"),
    (json.dumps({"layers": []}), '"layers" is not a JSON object'),
    (json.dumps([1, 2]), "is not a JSON object"),
    ("{not json", "is not valid JSON"),
    (b"\xff\xfe\x00binary", "not UTF-8 text"),
])
def test_a_bad_file_is_one_line(tmp_path, content, message):
    path = tmp_path / METADATA_FILE
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SparsekitError, match=message):
        PruneMetadata.read(tmp_path)


def test_encode_refuses_a_newer_schema_in_one_line(tmp_path):
    make_pruned(tmp_path / "pruned")
    (tmp_path / "pruned" / METADATA_FILE).write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1}))
    res = runner.invoke(app, ["encode", str(tmp_path / "pruned"), "-o", str(tmp_path / "packed")])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1 and "newer sparsekit" in res.stderr


def test_prune_writes_it_and_encode_carries_it(tmp_path):
    from sparsekit.packed.encoding import encode_checkpoint
    from sparsekit.pruning.api import prune
    from tiny_models import save_tiny

    save_tiny("llama", tmp_path / "tiny")
    report = prune(str(tmp_path / "tiny"), method="magnitude", sparsity=0.5, output=tmp_path / "pruned",
                   device="cpu", warn=lambda m: None)
    meta = PruneMetadata.read(tmp_path / "pruned")
    assert meta.schema_version == SCHEMA_VERSION and meta.method == "magnitude" and meta.layers == report["layers"]
    encode_checkpoint(tmp_path / "pruned", tmp_path / "packed")
    assert PruneMetadata.read(tmp_path / "packed") == meta


def test_only_the_model_reads_or_writes_the_file():
    """It was read by hand in six places; now the file name appears in code only where it is defined
    (and among the output markers, which only test that it exists)."""
    allowed = {"sparsekit/hf/metadata.py", "sparsekit/host/manifest.py"}
    found = []
    for folder in ("sparsekit", "cli", "kernels"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Constant) and node.value == METADATA_FILE and rel not in allowed:
                    found.append(f"{rel}:{node.lineno}")
    assert found == []
