"""Issue 15 (part 1): output writing that keeps every promise, for every command that writes.

prune, encode, export-bitmask, import-bitmask and the demo conversion share ``sparsekit.host.atomic``:
a lock on the output for the whole run, checks before any work, a rename that never replaces what
it did not mean to, one-line errors for a full or unwritable disk, clean-up after SIGTERM and after
a killed run, and an ``--overwrite`` that replaces only sparsekit outputs. Each test failed before.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from sparsekit.host.manifest import STAGING_MARKER
from sparsekit.packed.encoding import encode
from sparsekit.packed.interchange import export_bitmask, import_bitmask
from sparsekit.pruning.api import prune

from test_packing import make_pruned
from tiny_models import make_model, make_tokenizer, save_tiny

runner = CliRunner()


@pytest.fixture(scope="module")
def srcs(tmp_path_factory):
    """A tiny pruned checkpoint, its sparse-bitmask export and a tiny dense Llama."""
    d = tmp_path_factory.mktemp("outputs")
    make_pruned(d / "pruned")
    export_bitmask(d / "pruned", d / "bitmask")
    save_tiny("llama", d / "base")
    return d


def _beside(out: Path) -> list[str]:
    """What sits beside ``out`` under its name: the output, temp / old folders, the lock."""
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _wait_for(path: Path, proc: subprocess.Popen, what: str) -> None:
    """Wait until the child process has written ``path`` (an event, not a delay)."""
    deadline = time.monotonic() + 180
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the child exited ({proc.returncode}) before {what}: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the child never reached {what}")
        time.sleep(0.02)


def _child(script: str, *args, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ----------------------------------------------------------------------------- 1. concurrent writers
HOLD_SCRIPT = """
import os, sys, time
from pathlib import Path
from sparsekit.packed.encoding import encode

src, out, started, go = map(Path, sys.argv[1:5])
parent, deadline = os.getppid(), time.time() + 600

def progress(stage, done, total, item=""):
    if done == 1:
        started.write_text(str(os.getpid()))
        while not go.exists():   # (the test that started it killed or hung: do not wait forever)
            if os.getppid() != parent or time.time() > deadline:
                sys.exit("the test that started this writer is gone")
            time.sleep(0.02)

encode(src, out, progress=progress, force=True)
print("child wrote", out)
"""


def test_second_writer_fails_at_once_naming_the_pid(srcs, tmp_path):
    """Two runs to one path both said "wrote" and the first result was silently replaced."""
    out = tmp_path / "x"
    started, go = tmp_path / "started", tmp_path / "go"
    child = _child(HOLD_SCRIPT, srcs / "pruned", out, started, go, cwd=tmp_path)
    try:
        _wait_for(started, child, "its first tensor")   # the child holds the output, mid-write
        for run in (lambda: encode(srcs / "pruned", out),
                    lambda: prune(str(tmp_path / "no-such-model"), method="magnitude", output=out),  # before loading
                    lambda: export_bitmask(srcs / "pruned", out, overwrite=True)):
            with pytest.raises(SparsekitError, match=rf"being written by another sparsekit run \(PID {child.pid}"):
                run()
        res = runner.invoke(app, ["encode", str(srcs / "pruned"), "-o", str(out)])
        assert res.exit_code == 2 and f"PID {child.pid}" in res.stderr and "Traceback" not in res.output
    finally:
        go.write_text("")
        stdout, stderr = child.communicate(timeout=180)
    assert child.returncode == 0, stderr
    assert "child wrote" in stdout
    assert json.loads((out / "tcabme.index.json").read_text())["metadata"]["force"] is True  # the child's result
    assert _beside(out) == ["x"]


def test_rename_never_replaces_an_output_that_appeared_meanwhile(srcs, tmp_path):
    """The final rename replaced whatever had appeared at the path during the run."""
    out = tmp_path / "x"

    def outsider(stage, done, total, item=""):   # a program that ignores the lock makes the output
        if done == 1:
            out.mkdir()
            (out / "theirs.txt").write_text("theirs")
    with pytest.raises(SparsekitError, match="appeared while this run was writing"):
        encode(srcs / "pruned", out, progress=outsider)
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    assert _beside(out) == ["x"]


def test_overwrite_swaps_in_the_new_output_and_leaves_no_old_folder(srcs, tmp_path, monkeypatch):
    from sparsekit.host import atomic

    out = tmp_path / "x"
    encode(srcs / "pruned", out)
    real = atomic.rename_noreplace

    def fails(src, dst):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(atomic, "rename_noreplace", fails)   # the swap fails half-way: the old output comes back
    with pytest.raises(SparsekitError, match="Input/output error"):
        encode(srcs / "pruned", out, overwrite=True, force=True)
    assert json.loads((out / "tcabme.index.json").read_text())["metadata"]["force"] is False
    assert _beside(out) == ["x"]
    monkeypatch.setattr(atomic, "rename_noreplace", real)
    encode(srcs / "pruned", out, overwrite=True, force=True)
    assert json.loads((out / "tcabme.index.json").read_text())["metadata"]["force"] is True
    assert _beside(out) == ["x"]


# ----------------------------------------------------------------------------- 2. unwritable or full
def _refuse_lock_files(monkeypatch, err: int):
    """The output's parent refuses new files (read-only or no permission), like a chmod 555 dir for non-root."""
    real_open = os.open

    def fake_open(path, flags, *a, **k):
        if str(path).endswith(".lock") and flags & os.O_CREAT:
            raise OSError(err, os.strerror(err), str(path))
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(os, "open", fake_open)


@pytest.mark.parametrize("err, words", [(errno.EACCES, "permission denied"), (errno.EROFS, "read-only")])
def test_unwritable_location_fails_before_any_work(srcs, tmp_path, monkeypatch, err, words):
    """A read-only output location failed with a 63-line traceback after all the work."""
    from sparsekit.packed import tcabme

    packed = []
    monkeypatch.setattr(tcabme, "encode", lambda w: packed.append(w))
    _refuse_lock_files(monkeypatch, err)
    out = tmp_path / "ro" / "x"
    for run in (lambda: encode(srcs / "pruned", out),
                lambda: export_bitmask(srcs / "pruned", out),
                lambda: import_bitmask(srcs / "bitmask", out),
                lambda: prune(str(tmp_path / "no-such-model"), method="magnitude", output=out)):  # before loading
        with pytest.raises(SparsekitError, match=words):
            run()
    assert packed == [] and not (tmp_path / "ro").exists()
    res = runner.invoke(app, ["encode", str(srcs / "pruned"), "-o", str(out)])
    assert res.exit_code == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_too_little_space_fails_before_any_work(srcs, tmp_path, monkeypatch):
    """A full disk was found only when writing, after all the work."""
    from sparsekit.packed import tcabme

    packed = []
    monkeypatch.setattr(tcabme, "encode", lambda w: packed.append(w))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(total=10**12, used=10**12 - 1000, free=1000))
    out = tmp_path / "x"
    for run in (lambda: encode(srcs / "pruned", out),
                lambda: export_bitmask(srcs / "pruned", out),
                lambda: import_bitmask(srcs / "bitmask", out),
                lambda: prune(str(srcs / "base"), method="magnitude", output=out, device="cpu")):
        with pytest.raises(SparsekitError, match="not enough space"):
            run()
    assert packed == [] and _beside(out) == []


def test_disk_full_while_writing_is_one_line_and_leaves_nothing(srcs, tmp_path, monkeypatch):
    """ENOSPC mid-write was a traceback with exit 1 (prune, encode, export-bitmask, import-bitmask)."""
    import safetensors.torch
    import transformers

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "x"
    for run in (lambda: encode(srcs / "pruned", out),
                lambda: export_bitmask(srcs / "pruned", out),
                lambda: import_bitmask(srcs / "bitmask", out),
                lambda: prune(str(srcs / "base"), method="magnitude", output=out, device="cpu", warn=lambda m: None)):
        with pytest.raises(SparsekitError, match="no space left on the device while writing") as e:
            run()
        assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
        assert _beside(out) == []
    for cmd in (["encode", str(srcs / "pruned")], ["export-bitmask", str(srcs / "pruned")],
                ["import-bitmask", str(srcs / "bitmask")]):
        res = runner.invoke(app, [*cmd, "-o", str(out)])
        assert res.exit_code == 2, res.output
        assert len(res.stderr.strip().splitlines()) == 1 and "no space left" in res.stderr
        assert _beside(out) == []



FULL_SCRIPT = """
import json, resource, signal, sys
from typer.testing import CliRunner
from sparsekit.cli.app import app

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))   # no file may grow past 20 kB: the disk is full
out = []
for cmd in json.loads(sys.argv[1]):
    res = CliRunner().invoke(app, cmd)
    out.append([res.exit_code, res.stderr, repr(res.exception)])
print(json.dumps(out))
"""


def test_disk_full_in_safetensors_is_one_line_and_leaves_nothing(srcs, tmp_path):
    """Issue 25 item 4: the disk filling after the space check passed was a traceback (rc 1) from
    safetensors' own error type (``SafetensorError ... No space left on device``) for prune (in
    memory), encode, export-bitmask and import-bitmask. Real writes here, under a file-size limit."""
    out = tmp_path / "x"
    cmds = [["prune", str(srcs / "base"), "--method", "magnitude", "--device", "cpu", "--offload", "memory"],
            ["encode", str(srcs / "pruned")], ["export-bitmask", str(srcs / "pruned")],
            ["import-bitmask", str(srcs / "bitmask")]]
    child = _child(FULL_SCRIPT, json.dumps([[*c, "-o", str(out)] for c in cmds]), cwd=tmp_path)
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr
    for cmd, (code, err, exc) in zip(cmds, json.loads(stdout.splitlines()[-1])):
        assert code == 2, (cmd[0], err, exc)
        last = err.strip().splitlines()[-1]   # (prune's progress bars come first)
        assert "Traceback" not in err and last.startswith("error: ") and err.count("error") == 1, err
        assert "File too large" in last and "nothing was written" in last, err
    assert _beside(out) == []


def test_safetensors_no_space_names_the_cause(srcs, tmp_path, monkeypatch):
    import safetensors.torch
    import transformers
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "x"
    for run in (lambda: encode(srcs / "pruned", out),
                lambda: prune(str(srcs / "base"), method="magnitude", output=out, device="cpu", warn=lambda m: None)):
        with pytest.raises(SparsekitError, match="no space left on the device while writing") as e:
            run()
        assert e.value.errno == errno.ENOSPC and _beside(out) == []


# ----------------------------------------------------------------------------- 3. killed runs
KILL_SCRIPT = """
import os, signal, sys
from pathlib import Path
from sparsekit.packed.encoding import encode

src, out = map(Path, sys.argv[1:3])

def progress(stage, done, total, item=""):
    if done == 3:
        os.kill(os.getpid(), signal.SIGKILL)

encode(src, out, progress=progress, max_shard_size="1KB")
"""


def _killed_run(src: Path, out: Path) -> str:
    """Start encode src -> out in a child that SIGKILLs itself mid-write; the temp folder it left."""
    child = _child(KILL_SCRIPT, src, out, cwd=out.parent)
    child.communicate(timeout=180)
    assert child.returncode == -signal.SIGKILL
    left = [n for n in _beside(out) if ".tmp-" in n]
    assert len(left) == 1, _beside(out)
    return left[0]


def test_leftovers_of_a_killed_run_are_removed_by_the_next_and_reported(srcs, tmp_path):
    """kill -9 left .NAME.tmp-* (65-270 MB) for good; a later successful run left it too."""
    out = tmp_path / "x"
    left = _killed_run(srcs / "pruned", out)
    res = runner.invoke(app, ["encode", str(srcs / "pruned"), "-o", str(tmp_path / "y")])   # a run beside it
    assert res.exit_code == 0, res.output
    assert f"removed {tmp_path / left}" in res.stderr and "interrupted sparsekit run" in res.stderr
    assert _beside(out) == []
    left = _killed_run(srcs / "pruned", out)
    notes = []
    encode(srcs / "pruned", out, warn=notes.append)    # the next run to the same path
    assert len(notes) == 1 and f"removed {tmp_path / left}" in notes[0]
    assert _beside(out) == ["x"]
    old = tmp_path / f".x.old-{_dead_pid()}-abc123"   # an --overwrite killed after the swap, while deleting the old
    old.mkdir()
    (old / "w.safetensors").write_bytes(b"0" * 1000)
    (old / "tcabme.index.json").write_text("{}")      # what is left of a sparsekit output: its marks go last
    notes = []
    encode(srcs / "pruned", out, overwrite=True, warn=notes.append)
    assert len(notes) == 1 and f"removed {old}" in notes[0] and _beside(out) == ["x"]


def test_an_overwrite_killed_between_its_renames_gets_the_old_output_back(srcs, tmp_path):
    out = tmp_path / "x"
    encode(srcs / "pruned", out)
    os.rename(out, tmp_path / f".x.old-{_dead_pid()}-abc123")   # killed after moving the old output aside
    notes = []
    with pytest.raises(SparsekitError, match="already exists"):
        encode(srcs / "pruned", out, warn=notes.append)
    assert "restored" in notes[0] and (out / "tcabme.index.json").is_file() and _beside(out) == ["x"]


def test_demo_conversion_locks_and_cleans_its_cache(tmp_path, monkeypatch, capsys):
    """A killed demo conversion left its temp folder in the model cache."""
    import transformers

    from sparsekit.hf import models

    tok = make_tokenizer()

    def fake_model(folder, gguf_file=None, dtype=None):
        m = make_model("llama", vocab_size=len(tok))
        m.config.quantization_config = {"quant_method": "gguf", "gguf_file": gguf_file}
        return m
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda folder, gguf_file=None: tok)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPARSEKIT_DEMO_GGUF", str(tmp_path / "m.gguf"))
    out = models.demo_cache_dir()
    pid = _dead_pid()
    stale = out.parent / f".{out.name}.tmp-{pid}-killed1"
    stale.mkdir(parents=True)
    (stale / STAGING_MARKER).write_text(json.dumps({"pid": pid, "output": out.name}))   # as a killed run leaves it
    (stale / "model.safetensors").write_bytes(b"0" * 4096)
    assert models.ensure_demo_model() == out
    assert "removed" in capsys.readouterr().err
    assert (out / "config.json").is_file() and _beside(out) == [out.name]


# ----------------------------------------------------------------------------- 4. SIGTERM
TERM_SCRIPT = """
import sys, time
from pathlib import Path
from sparsekit.packed import tcabme

src, out, started = sys.argv[1:4]

def slow_encode(w):
    Path(started).write_text("")
    time.sleep(600)

tcabme.encode = slow_encode
from sparsekit.cli.app import app

sys.argv = ["sparsekit", "encode", src, "-o", out, "--force"]
app()
"""


def test_sigterm_cleans_up_like_ctrl_c(srcs, tmp_path):
    """SIGTERM had no handler: the process died and left its temp folder."""
    out, started = tmp_path / "x", tmp_path / "started"
    child = _child(TERM_SCRIPT, srcs / "pruned", out, started, cwd=tmp_path)
    _wait_for(started, child, "the packing")
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 143, stderr
    assert "terminated" in stderr and "Traceback" not in stderr
    assert _beside(out) == []


# ----------------------------------------------------------------------------- 5. what --overwrite may replace
def test_overwrite_refuses_the_working_directory_and_its_ancestors(srcs, tmp_path, monkeypatch):
    """`cd s/a/b && sparsekit encode ... -o ../../a --overwrite` deleted s/a, an unrelated file and the cwd."""
    (tmp_path / "s" / "a" / "b").mkdir(parents=True)
    (tmp_path / "s" / "a" / "sparsekit.json").write_text("{}")   # even one that looks like an output
    (tmp_path / "s" / "a" / "mine.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "s" / "a" / "b")
    for out in ("../../a", "..", ".", str(tmp_path / "s")):
        for run in (lambda: encode(srcs / "pruned", out, overwrite=True),
                    lambda: export_bitmask(srcs / "pruned", out, overwrite=True),
                    lambda: import_bitmask(srcs / "bitmask", out, overwrite=True)):
            with pytest.raises(SparsekitError, match="current directory or one above it"):
                run()
    res = runner.invoke(app, ["encode", str(srcs / "pruned"), "-o", "../../a", "--overwrite"])
    assert res.exit_code == 2 and "current directory" in res.stderr
    assert (tmp_path / "s" / "a" / "mine.txt").read_text() == "mine" and Path.cwd().is_dir()


def test_overwrite_refuses_the_input_and_what_contains_it_or_lies_inside_it(srcs, tmp_path):
    src = tmp_path / "wrap" / "pruned"
    shutil.copytree(srcs / "pruned", src)
    (tmp_path / "wrap" / "sparsekit.json").write_text("{}")
    inner = src / "inner"
    inner.mkdir()
    (inner / "sparsekit.json").write_text("{}")
    for out, what in ((src, "is the input"), (tmp_path / "wrap", "contains the input"), (inner, "is inside the input")):
        for run in (lambda: export_bitmask(src, out, overwrite=True),
                    lambda: encode(src, out, overwrite=True) if out != src else export_bitmask(src, out, overwrite=True)):
            with pytest.raises(SparsekitError, match=what):
                run()
    assert (src / "model.safetensors").is_file() and (inner / "sparsekit.json").is_file()


def test_overwrite_refuses_what_is_not_a_sparsekit_output(srcs, tmp_path):
    """`encode -o FILE --overwrite` replaced a file with a directory and left .FILE.old-PID."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_text("mine")
    for out, words in ((a_file, "is a file"), (other, "not a sparsekit output")):
        for run in (lambda: encode(srcs / "pruned", out, overwrite=True),
                    lambda: export_bitmask(srcs / "pruned", out, overwrite=True),
                    lambda: import_bitmask(srcs / "bitmask", out, overwrite=True),
                    lambda: prune(str(tmp_path / "no-such-model"), method="magnitude", output=out, overwrite=True)):
            with pytest.raises(SparsekitError, match=words):
                run()
        res = runner.invoke(app, ["encode", str(srcs / "pruned"), "-o", str(out), "--overwrite"])
        assert res.exit_code == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert a_file.read_text() == "mine" and (other / "cat.jpg").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "photos"]


def test_overwrite_replaces_every_kind_of_sparsekit_output(srcs, tmp_path):
    """Outputs of every writer (and an empty directory) can be replaced, including an export of a
    checkpoint without sparsekit.json (marked .sparsekit-output)."""
    plain = tmp_path / "plain"
    shutil.copytree(srcs / "bitmask", plain)
    for name in ("sparsekit.json", ".sparsekit-output"):   # a sparse-bitmask checkpoint from elsewhere
        (plain / name).unlink(missing_ok=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    runs = [lambda o: encode(srcs / "pruned", o, overwrite=True),
            lambda o: export_bitmask(srcs / "pruned", o, overwrite=True),
            lambda o: import_bitmask(plain, o, overwrite=True)]
    for i, first in enumerate(runs):
        out = tmp_path / f"o{i}"
        first(out)
        for again in runs:
            again(out)
        assert _beside(out) == [out.name]
    encode(srcs / "pruned", empty, overwrite=True)
    assert (empty / "tcabme.index.json").is_file()
