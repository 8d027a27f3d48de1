"""Checkpoints of a learning run: the logits, the optimizer and learning-rate states, the best mask
so far on the held-out windows, the step and the loss history.

One file per checkpoint, ``step-NNNNNN.pt`` in the checkpoint directory, written to a temporary
name and renamed into place (a killed run never leaves half a checkpoint). A checkpoint records the
run's *fingerprint* (model, method, pattern, sparsity, allocation, seed, calibration, schedule); a
resume refuses one whose fingerprint differs. Since every random draw of a step depends only on the
seed and the step (``schedule.py``), resuming gives what the uninterrupted run gives.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from sparsekit.errors import SparsekitError

_NAME = re.compile(r"^step-(\d+)\.pt$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:06d}.pt"


def latest(directory: str | Path) -> Path | None:
    d = Path(directory)
    if not d.is_dir():
        return None
    found = sorted((int(m.group(1)), f) for f in d.iterdir() if (m := _NAME.match(f.name)))
    return found[-1][1] if found else None


def save(directory: str | Path, step: int, logits: dict[str, torch.Tensor], loop_state: dict,
         history: list[float], fingerprint: dict) -> Path:
    """Write the state after ``step`` steps (``loop_state``: optimizer, scheduler, best mask so far);
    returns the file."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(d, step)
    tmp = d / f".{path.name}.tmp-{os.getpid()}"
    state = {"step": int(step), "logits": {k: v.detach().cpu() for k, v in logits.items()},
             **loop_state, "history": list(history), "fingerprint": fingerprint}
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load(directory: str | Path, fingerprint: dict) -> dict:
    """The latest checkpoint in ``directory``, checked against ``fingerprint``."""
    path = latest(directory)
    if path is None:
        raise SparsekitError(f"--resume: no checkpoint (step-*.pt) in {directory}: run without --resume, "
                             "or pass the --checkpoint-dir the interrupted run wrote to")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a damaged or foreign file
        raise SparsekitError(f"cannot read checkpoint {path} ({type(e).__name__}): remove it to resume from the one before") from None
    saved = state.get("fingerprint", {})
    diff = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
    if diff:
        k = diff[0]
        raise SparsekitError(f"checkpoint {path} belongs to another run ({k}: {saved.get(k)!r} there, "
                             f"{fingerprint.get(k)!r} now): resume with the same settings or drop --resume")
    state["path"] = str(path)
    return state
