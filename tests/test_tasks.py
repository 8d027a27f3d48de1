"""`sparsekit eval --tasks`: zero-shot accuracy through lm-evaluation-harness, offline.

The task is tests/data/tasks/tiny_mc.yaml (12 multiple-choice questions from a jsonl beside it; its
``data_files`` path is relative, so these tests run from that folder). The accuracy lm-eval reports
must equal the one computed here by scoring each choice's log-likelihood directly with the same model.
Tests that need lm-eval skip cleanly without it (``pip install "sparsekit[tasks]"``, or the test extra).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.errors import SparsekitError
from tiny_models import save_tiny, write_corpus

TASKS_DIR = Path(__file__).resolve().parent / "data" / "tasks"
TASK = "sparsekit_tiny_mc"
runner = CliRunner()


def need_lm_eval():
    pytest.importorskip("lm_eval", reason='lm-eval is not installed: pip install "sparsekit[tasks]"')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    return save_tiny("llama", d / "model"), write_corpus(d / "calib.txt", seed=2)


@pytest.fixture
def in_tasks_dir(monkeypatch):
    monkeypatch.chdir(TASKS_DIR)  # the task's data_files path is relative to the working directory


def only_local_tasks(monkeypatch):
    """The CLI's TaskManager without lm-eval's own tasks: indexing those takes ~9 s a run."""
    from sparsekit.evaluation import tasks

    make = tasks.task_manager
    monkeypatch.setattr(tasks, "task_manager", lambda include_path=None: make(include_path, include_defaults=False))


def questions(limit=None) -> list[dict]:
    rows = [json.loads(line) for line in (TASKS_DIR / "tiny_mc.jsonl").read_text().splitlines() if line.strip()]
    return rows[:limit]


@torch.no_grad()
def reference_accuracy(model, tok, rows) -> tuple[float, float]:
    """acc / acc_norm by hand: the prompt is the task's doc_to_text, each choice follows after one space;
    the continuation's tokens are those of prompt+choice past the prompt's; the choice with the largest
    summed log-probability wins (acc_norm: divided by the choice's length in characters)."""
    acc, acc_norm = [], []
    for r in rows:
        ctx = f"Question: {r['question']}\nAnswer:"
        ctx_ids = tok(ctx).input_ids
        lls = []
        for choice in r["choices"]:
            whole = tok(ctx + " " + choice).input_ids
            assert whole[: len(ctx_ids)] == ctx_ids
            logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
            lls.append(sum(float(logp[t - 1, whole[t]]) for t in range(len(ctx_ids), len(whole))))
        norm = [ll / len(c) for ll, c in zip(lls, r["choices"])]
        for scores in (lls, norm):  # no near-ties: the argmax cannot flip on float noise
            top = sorted(scores, reverse=True)
            assert top[0] - top[1] > 1e-4
        acc.append(max(range(len(lls)), key=lls.__getitem__) == r["answer"])
        acc_norm.append(max(range(len(norm)), key=norm.__getitem__) == r["answer"])
    return sum(acc) / len(acc), sum(acc_norm) / len(acc_norm)


def test_accuracy_equals_direct_loglikelihood_scoring(tiny, in_tasks_dir):
    need_lm_eval()
    from sparsekit.evaluation.tasks import evaluate_tasks, task_manager
    from sparsekit.runtime.loader import load

    model, tok = load(str(tiny[0]))
    out = evaluate_tasks(model, tok, [TASK], manager=task_manager(TASKS_DIR, include_defaults=False))
    (row,) = out["tasks"]
    want_acc, want_norm = reference_accuracy(model, tok, questions())
    assert row["task"] == TASK and row["samples"] == 12 and row["num_fewshot"] == 0
    assert row["acc"] == pytest.approx(want_acc, abs=1e-9)
    assert row["acc_norm"] == pytest.approx(want_norm, abs=1e-9)
    n = 12
    assert row["acc_stderr"] == pytest.approx((want_acc * (1 - want_acc) / (n - 1)) ** 0.5, rel=1e-6)


def test_cli_on_a_packed_model_runs_the_sparse_runtime(tiny, tmp_path, in_tasks_dir, monkeypatch):
    """prune -> encode -> eval --tasks: the packed directory is scored through SparseLinear, and the
    figure equals the direct scoring of that same loaded model; --json leaves only JSON on stdout."""
    need_lm_eval()
    from sparsekit.packed.encoding import encode
    from sparsekit.pruning.api import prune
    from sparsekit.runtime.loader import load
    from sparsekit.runtime.sparse_linear import SparseLinear

    model_dir, calib = tiny
    pruned, packed = tmp_path / "pruned", tmp_path / "packed"
    prune(str(model_dir), method="wanda", pattern="2:4", calib=str(calib), nsamples=4, seqlen=32,
          device="cpu", output=pruned, warn=lambda m: None)
    encode(pruned, packed)
    res = runner.invoke(app, ["eval", str(packed), "--tasks", TASK, "--include-path", str(TASKS_DIR),
                              "--limit", "8", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert set(report) == {"model", "tasks"}  # --tasks alone: no perplexity run
    (row,) = report["tasks"]["tasks"]
    assert row["samples"] == 8 and report["tasks"]["limit"] == 8

    model, tok = load(str(packed), device="cpu")
    assert any(isinstance(m, SparseLinear) for m in model.modules())
    want_acc, want_norm = reference_accuracy(model, tok, questions(8))
    assert row["acc"] == pytest.approx(want_acc, abs=1e-9) and row["acc_norm"] == pytest.approx(want_norm, abs=1e-9)

    only_local_tasks(monkeypatch)  # the run above indexed lm-eval's own tasks too, as users get them
    res = runner.invoke(app, ["eval", str(packed), "--tasks", TASK, "--include-path", str(TASKS_DIR),
                              "--limit", "8", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "Zero-shot accuracy" in res.stdout and TASK in res.stdout and f"{want_acc:.4f}" in res.stdout
    assert "--limit 8" in res.stderr


def test_offline_dataset_is_one_line(tiny, in_tasks_dir, monkeypatch):
    need_lm_eval()
    from sparsekit.evaluation.tasks import evaluate_tasks, task_manager
    from sparsekit.runtime.loader import load

    model, tok = load(str(tiny[0]))
    with pytest.raises(SparsekitError, match="cannot download the dataset .*offline"):
        evaluate_tasks(model, tok, ["sparsekit_tiny_hub"], manager=task_manager(TASKS_DIR, include_defaults=False))
    only_local_tasks(monkeypatch)
    res = runner.invoke(app, ["eval", str(tiny[0]), "--tasks", "sparsekit_tiny_hub", "--include-path", str(TASKS_DIR),
                              "--device", "cpu"])
    assert res.exit_code == 2, res.output
    err = res.stderr.strip()
    assert err.startswith("error:") and "offline" in err and "--include-path" in err and len(err.splitlines()) == 1



def test_a_relative_data_path_read_from_another_folder_is_one_line(tiny, tmp_path, monkeypatch):
    """Issue 25 item 6: `eval --tasks NAME --include-path DIR` run from another folder than DIR, when
    the task's data path is relative, was a 229-line traceback ending in FileNotFoundError."""
    need_lm_eval()
    only_local_tasks(monkeypatch)
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["eval", str(tiny[0]), "--tasks", TASK, "--include-path", str(TASKS_DIR),
                              "--device", "cpu"])
    assert res.exit_code == 2, res.output
    err = res.stderr.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and "Traceback" not in res.output, err
    assert "tiny_mc.jsonl" in err and "relative" in err and str(tmp_path) in err

def test_unknown_task_is_refused_before_loading(tiny, monkeypatch):
    need_lm_eval()
    from sparsekit.evaluation import tasks

    manager = tasks.task_manager(TASKS_DIR, include_defaults=False)
    with pytest.raises(SparsekitError, match="unknown task no_such_task"):
        tasks.check_tasks(manager, [TASK, "no_such_task"])
    only_local_tasks(monkeypatch)
    res = runner.invoke(app, ["eval", "./no/such/model", "--tasks", "no_such_task"])
    assert res.exit_code == 2 and "unknown task no_such_task" in res.stderr  # names first, then DIR


def test_without_lm_eval_one_line_install_hint(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    res = runner.invoke(app, ["eval", str(tiny[0]), "--tasks", "arc_easy"])
    assert res.exit_code == 2
    err = res.stderr.strip()
    assert err.startswith("error:") and 'pip install "sparsekit[tasks]"' in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--limit", "5"], "apply to --tasks"),
    (["--include-path", "."], "apply to --tasks"),
    (["--tasks", "x", "--limit", "0"], "--limit must be >= 1"),
    (["--tasks", " , "], "names no task"),
])
def test_option_errors(tiny, args, message):
    res = runner.invoke(app, ["eval", str(tiny[0]), *args])
    assert res.exit_code == 2 and message in res.stderr, res.output


def test_parse_tasks():
    from sparsekit.evaluation.tasks import parse_tasks

    assert parse_tasks("arc_easy, hellaswag,arc_easy") == ["arc_easy", "hellaswag"]
