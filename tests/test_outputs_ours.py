"""Issue 25 (items 1, 2): a writer touches only what it provably wrote.

The sweep of what killed runs left removes a folder beside the output only when it carries the
output's own name, a PID that is gone, and the marker sparsekit writes into its own temp folders (or,
for a previous output moved aside, the marks of a sparsekit output); anything else is another
program's. ``--overwrite`` refuses an output holding files sparsekit did not write, naming them,
unless ``--delete-extra`` says to delete them too.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from sparsekit.packed.encoding import encode
from sparsekit.packed.interchange import export_bitmask

from test_packing import make_pruned

runner = CliRunner()


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    d = tmp_path_factory.mktemp("ours") / "pruned"
    make_pruned(d)
    return d


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_sweep_leaves_other_programs_files_alone(pruned, tmp_path):
    """`encode -o out/nb` deleted out/.mydata.tmp-12345/thesis.txt, out/.cache.tmp-abcdefgh/f and the file
    out/.notes.tmp-99999, and renamed out/.photos.old-4242 to out/photos."""
    out = tmp_path / "out"
    dead = _dead_pid()
    theirs = {
        f".mydata.tmp-{dead}/thesis.txt": "chapter 1",
        ".cache.tmp-abcdefgh/f": "cached",
        f".photos.old-{dead}/cat.jpg": "a cat",
        f".nb.tmp-{dead}-abc123/draft.txt": "the output's own name, but no sparsekit marker",
        f".nb.old-{dead}-abc123/notes.txt": "the output's own name, but not a sparsekit output",
    }
    for rel, text in theirs.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    (out / f".notes.tmp-{dead}").write_text("a file, never a sparsekit folder")
    (out / f".nb2.tmp-{dead}-abc123").write_text("a file under an output's name")
    before = _tree(out)
    notes = []
    encode(pruned, out / "nb", warn=notes.append)
    export_bitmask(pruned, out / "nb2", warn=notes.append)
    assert notes == []
    after = _tree(out)
    assert {k: v for k, v in after.items() if not k.startswith(("nb/", "nb2/"))} == before
    assert not (out / "photos").exists()


def test_the_sweep_still_removes_a_killed_runs_folder(pruned, tmp_path):
    """What a killed run leaves (its marker inside, its PID gone) is still swept, and only that."""
    from sparsekit.host.manifest import STAGING_MARKER

    dead = _dead_pid()
    left = tmp_path / f".x.tmp-{dead}-k1ll3d"
    left.mkdir()
    (left / STAGING_MARKER).write_text(f'{{"pid": {dead}, "output": "x"}}\n')
    (left / "tcabme-00001.part").write_bytes(b"0" * 100)
    alive = tmp_path / f".x.tmp-{_alive_pid()}-stillw"   # a live writer's (a PID that exists)
    alive.mkdir()
    (alive / STAGING_MARKER).write_text("{}")
    notes = []
    encode(pruned, tmp_path / "x", warn=notes.append)
    assert len(notes) == 1 and f"removed {left}" in notes[0]
    assert not left.exists() and alive.is_dir()


def _alive_pid() -> int:
    import os

    return os.getppid()


def test_overwrite_refuses_an_output_holding_files_sparsekit_did_not_write(pruned, tmp_path):
    """--overwrite deleted mynotes.txt and myresults/r.csv that the user had put inside the output."""
    out = tmp_path / "nb"
    encode(pruned, out)
    (out / "mynotes.txt").write_text("mine")
    (out / "myresults").mkdir()
    (out / "myresults" / "r.csv").write_text("1,2")
    with pytest.raises(SparsekitError, match=r"holds 2 files sparsekit did not write \(mynotes\.txt, "
                                             r"myresults/r\.csv\).*--delete-extra"):
        encode(pruned, out, overwrite=True)
    res = runner.invoke(app, ["encode", str(pruned), "-o", str(out), "--overwrite"])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert "mynotes.txt" in res.stderr and "--delete-extra" in res.stderr
    assert (out / "mynotes.txt").read_text() == "mine" and (out / "myresults" / "r.csv").read_text() == "1,2"
    res = runner.invoke(app, ["encode", str(pruned), "-o", str(out), "--overwrite", "--delete-extra", "--force"])
    assert res.exit_code == 0, res.output
    assert not (out / "mynotes.txt").exists() and not (out / "myresults").exists()


def test_overwrite_lists_the_first_few_and_counts_the_rest(pruned, tmp_path):
    out = tmp_path / "nb"
    encode(pruned, out)
    for i in range(9):
        (out / f"mine{i}.txt").write_text("mine")
    with pytest.raises(SparsekitError, match=r"holds 9 files .*\(mine0\.txt, mine1\.txt, mine2\.txt, and 6 more\)"):
        export_bitmask(pruned, out, overwrite=True)


def test_every_output_records_the_files_it_wrote(pruned, tmp_path):
    """The record is what lets --overwrite tell sparsekit's files from the user's: it lists every file."""
    from sparsekit.host.manifest import written_files

    out = tmp_path / "nb"
    encode(pruned, out)
    on_disk = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert sorted(written_files(out)) == on_disk
