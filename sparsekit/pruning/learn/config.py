"""``LearnConfig``: the settings of one mask-learning run (``sparsekit prune --learn-mask``), validated."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from sparsekit.errors import SparsekitError


@dataclass
class LearnConfig:
    # steps and lr: from a GPU sweep on the demo model (hybrid 35%, 128 x 512 calibration windows, docs/results.md):
    # 300 steps at 0.1 overfit the 112 training windows (34.19); 150 at 0.05 gave 32.77 / 32.21 (seeds 0 / 1)
    steps: int = 150  # optimizer steps (0: the one-shot mask, e.g. for --allocation global alone)
    lr: float = 0.05  # Adam learning rate on the logits (after a linear warm-up)
    warmup: float = 0.1  # fraction of the steps over which the learning rate ramps up
    holdout: float = 0.125  # fraction of the calibration windows held out to pick the best mask (0: none)
    batch_size: int = 8  # calibration windows per step
    tau: tuple[float, float] = (1.0, 0.2)  # relaxation temperature, start -> end (geometric)
    noise: tuple[float, float] = (0.5, 0.0)  # scale of the Gumbel/logistic noise, start -> end (linear)
    prior: float = 3.0  # initial logit of the one-shot 2:4 choice of each group (others 0)
    tile_prior: float = 2.0  # initial tile logits: +/- this for one-shot sparse / dense tiles
    reg: float = 1.0  # weight of the sparsity regularizer
    distill: bool = False  # add KL(dense model || masked model) to the LM loss
    weight_update: bool = False  # recompute the kept weights with SparseGPT's sweep from the dense ones
    checkpoint_every: int = 0  # steps between checkpoints (0: none)
    checkpoint_dir: str | None = None  # default: <output>-checkpoints
    resume: bool = False  # continue from the latest checkpoint in checkpoint_dir

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "checkpoint_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "batch_size" else 0):
                raise SparsekitError(f"--{name.replace('_', '-')} must be a {'positive' if name == 'batch_size' else 'non-negative'} "
                                     f"integer, got {v!r}")
        for name in ("lr", "prior", "tile_prior", "reg", "warmup", "holdout"):
            v = float(getattr(self, name))
            if not math.isfinite(v) or v < 0 or (name == "lr" and v == 0):
                raise SparsekitError(f"--{name.replace('_', '-')} must be a {'positive' if name == 'lr' else 'non-negative'} "
                                     f"finite number, got {getattr(self, name)!r}")
            setattr(self, name, v)
        if self.warmup > 1 or self.holdout >= 1:
            raise SparsekitError(f"warmup must be a fraction in [0, 1] and holdout in [0, 1), got {self.warmup}, {self.holdout}")
        for name in ("tau", "noise"):
            pair = tuple(float(x) for x in getattr(self, name))
            if len(pair) != 2 or not all(math.isfinite(x) and x >= 0 for x in pair) or (name == "tau" and min(pair) <= 0):
                raise SparsekitError(f"{name} schedule must be two {'positive' if name == 'tau' else 'non-negative'} "
                                     f"numbers (start, end), got {getattr(self, name)!r}")
            setattr(self, name, pair)

    def heldout_windows(self, n: int) -> int:
        """How many of ``n`` calibration windows are held out (the last ones)."""
        return min(n - 1, max(1, round(n * self.holdout))) if self.holdout and n > 1 else 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tau"], d["noise"] = list(self.tau), list(self.noise)
        return d

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a checkpoint to be resumed (the schedule and the optimizer's settings)."""
        keep = ("steps", "lr", "warmup", "holdout", "batch_size", "tau", "noise", "prior", "tile_prior", "reg", "distill")
        return {f.name: self.as_dict()[f.name] for f in fields(self) if f.name in keep}
