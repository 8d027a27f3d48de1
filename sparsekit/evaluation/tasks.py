"""Zero-shot task accuracy through lm-evaluation-harness (``pip install "sparsekit[tasks]"``).

The model is the one sparsekit loads (``sparsekit.runtime.loader.load``: a packed directory runs its
linears as ``SparseLinear``), wrapped as it is in lm-eval's ``HFLM`` (which accepts a model instance
as ``pretrained``) and scored by ``lm_eval.simple_evaluate``: multiple-choice tasks compare the
log-likelihoods of the choices, ``acc`` by the raw sum, ``acc_norm`` divided by the choice's length in
characters. lm-eval is imported only here, and only when tasks are asked for.

Task datasets come from the Hugging Face hub (cached by ``datasets``); offline, a task whose dataset is
not cached is one clear error. Tasks of one's own (YAML files in lm-eval's format) are found through
``include_path``; tests use one that reads a local jsonl.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from typing import Any, Callable, Iterator, Optional

from sparsekit.errors import SparsekitError

INSTALL_HINT = 'pip install "sparsekit[tasks]"'
METRICS = ("acc", "acc_norm")
DEFAULT_BATCH_SIZE = 8


def parse_tasks(text: str) -> list[str]:
    """``"arc_easy, hellaswag"`` -> ``["arc_easy", "hellaswag"]`` (order kept, duplicates dropped)."""
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if not names:
        raise SparsekitError(f"--tasks {text!r} names no task: write e.g. --tasks arc_easy,hellaswag")
    return list(dict.fromkeys(names))


def require_lm_eval():
    """The ``lm_eval`` module, or a one-line error saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise SparsekitError(f"--tasks runs lm-evaluation-harness, which is not installed: {INSTALL_HINT}") from None
    return lm_eval


@contextlib.contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval logs a warning per call for a model instance and chatters at INFO: errors only."""
    log = logging.getLogger("lm_eval")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def task_manager(include_path: str | os.PathLike | None = None, include_defaults: bool = True):
    """lm-eval's ``TaskManager``: its own tasks (unless ``include_defaults`` is False) plus the YAML tasks
    under ``include_path``. Indexing lm-eval's own tasks takes a few seconds."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise SparsekitError(f"--include-path {include_path}: no such folder (it holds task YAML files)")
    with _quiet_lm_eval():
        return TaskManager(include_path=str(include_path) if include_path is not None else None,
                           include_defaults=include_defaults)


def check_tasks(manager, tasks: list[str]) -> None:
    """Every name must be a task, group or tag that ``manager`` knows (checked before a model is loaded)."""
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise SparsekitError(
            f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: `lm-eval ls tasks` lists "
            "lm-eval's tasks; for a task of your own pass its YAML folder with --include-path DIR")


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _offline_error(e: BaseException) -> bool:
    """A hub/download failure: the task's dataset could not be fetched (offline or the hub unreachable)."""
    for x in _chain(e):
        name = type(x).__name__
        text = str(x)
        if isinstance(x, ConnectionError) or name in ("LocalEntryNotFoundError", "OfflineModeIsEnabled",
                                                       "ConnectTimeout", "ConnectError", "ReadTimeout"):
            return True
        if "Couldn't reach" in text or "offline" in text.lower() or "HF_HUB_OFFLINE" in text:
            return True
    return False


def _dataset_error(e: BaseException) -> bool:
    for x in _chain(e):
        if type(x).__name__ in ("DatasetNotFoundError", "DataFilesNotFoundError", "EmptyDatasetError",
                                "RepositoryNotFoundError", "GatedRepoError") or type(x).__module__.startswith("datasets"):
            return True
    return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _number(x) -> Optional[float]:
    try:
        v = float(x)
    except (TypeError, ValueError):  # lm-eval writes "N/A" for a stderr it did not compute
        return None
    return v if math.isfinite(v) else None


def _rows(out: dict) -> list[dict[str, Any]]:
    """One row per task (and group) of lm-eval's results: ``acc``/``acc_norm`` with their stderr, the
    number of examples scored and of few-shot examples, plus every other numeric metric under ``metrics``."""
    rows = []
    groups = set(out.get("groups") or {})
    for name, res in out.get("results", {}).items():
        row: dict[str, Any] = {"task": name, "alias": str(res.get("alias", name)).strip(" -") or name}
        metrics: dict[str, Optional[float]] = {}
        for key, value in res.items():
            metric, sep, flt = key.partition(",")
            if not sep or metric.endswith("_stderr"):
                continue
            label = metric if flt == "none" else f"{metric},{flt}"
            metrics[label] = _number(value)
            metrics[f"{label}_stderr"] = _number(res.get(f"{metric}_stderr,{flt}"))
        for m in METRICS:
            row[m] = metrics.pop(m, None)
            row[f"{m}_stderr"] = metrics.pop(f"{m}_stderr", None)
        row["metrics"] = {k: v for k, v in metrics.items() if v is not None}
        n = (out.get("n-samples") or {}).get(name) or {}
        row["samples"] = n.get("effective")
        shots = (out.get("n-shot") or {}).get(name)
        row["num_fewshot"] = int(shots) if isinstance(shots, (int, float)) else None
        row["group"] = name in groups
        rows.append(row)
    return rows


def evaluate_tasks(model, tokenizer, tasks: list[str], *, limit: int | float | None = None,
                   num_fewshot: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE, manager=None,
                   include_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Score ``model`` (any HF causal LM, a packed one included) on lm-eval ``tasks``:
    ``{"tasks": [row per task], "lm_eval_version", "limit", "num_fewshot"}``.

    ``manager`` is a ``task_manager()`` (one is made from ``include_path`` when absent); ``limit`` scores
    only the first examples of each task (a quick look, not a published figure).
    """
    lm_eval = require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    if limit is not None and limit <= 0:
        raise SparsekitError(f"--limit must be positive, got {limit}")
    if manager is None:
        manager = task_manager(include_path)
    check_tasks(manager, tasks)
    with _quiet_lm_eval():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        try:
            out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                          num_fewshot=num_fewshot, log_samples=False, verbosity="ERROR")
        except Exception as e:
            if _offline_error(e):
                raise SparsekitError(
                    f"cannot download the dataset of --tasks {','.join(tasks)}: offline or the Hugging Face hub "
                    f"cannot be reached ({_first_line(e)}); run once with a connection to cache it, or use a "
                    "local task (--include-path DIR)") from None
            missing = next((x for x in _chain(e) if isinstance(x, FileNotFoundError)), None)
            if missing is not None:
                raise SparsekitError(
                    f"a data file of --tasks {','.join(tasks)} was not found ({_first_line(missing)}): a relative "
                    f"path in a task YAML (dataset_kwargs: data_files) is read from the current folder "
                    f"({os.getcwd()}), not from the YAML's; run from the folder it is relative to, or make "
                    "it absolute") from None
            if _dataset_error(e):
                raise SparsekitError(f"cannot load the dataset of --tasks {','.join(tasks)} ({_first_line(e)})") from None
            raise
    if not out or not out.get("results"):
        raise SparsekitError(f"lm-eval returned no results for --tasks {','.join(tasks)}")
    return {
        "tasks": _rows(out),
        "lm_eval_version": getattr(lm_eval, "__version__", None) or out.get("lm_eval_version"),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "batch_size": batch_size,
    }


def tasks_report(model_dir: str, *, tasks: list[str], limit: int | None = None, num_fewshot: int | None = None,
                 device: str = "auto", dtype: str = "auto", include_path: str | None = None, manager=None,
                 batch_size: int = DEFAULT_BATCH_SIZE, warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load ``model_dir`` (any model the loader opens) and score it on ``tasks``: the report
    ``sparsekit eval --tasks`` prints. lm-eval, the task names and DIR are checked before the model loads."""
    from sparsekit.hf.models import resolve_device, resolve_dtype, resolve_model
    from sparsekit.runtime.loader import load

    t0 = time.perf_counter()
    require_lm_eval()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(None if dtype == "auto" else dtype, dev)
    location = resolve_model(model_dir)
    if manager is None:
        manager = task_manager(include_path)
    check_tasks(manager, tasks)
    model, tokenizer = load(location, device=dev, dtype=torch_dtype)
    if limit is not None and warn is not None:
        warn(f"--limit {limit}: each task scores only its first {limit} examples (a quick look, not a published figure)")
    result = evaluate_tasks(model, tokenizer, tasks, limit=limit, num_fewshot=num_fewshot,
                            batch_size=batch_size, manager=manager)
    return {
        "model": str(model_dir),
        "device": str(dev),
        "dtype": str(torch_dtype).removeprefix("torch."),
        **result,
        "elapsed_s": time.perf_counter() - t0,
    }
