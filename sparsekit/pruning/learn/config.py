"""``LearnConfig``: the settings of one mask-learning run (``sparsekit prune --learn-mask``), validated."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from sparsekit.errors import SparsekitError


# The settings whose best value depends on the pattern (GPU sweeps on the demo model, 128 x 512 calibration
# windows, docs/results.md): for 2:4 from ADMM, noise 0.5 -> 1.0 and prior 3 -> 4 took WikiText-2 from
# 40.26 to 37.32 (noise 1.0 alone: 38.58-38.86); hybrid 35% met its target with the values it keeps.
PATTERN_DEFAULTS: dict[str, dict[str, Any]] = {
    "hybrid": {"noise": (0.5, 0.0), "prior": 3.0},
    "2:4": {"noise": (1.0, 0.0), "prior": 4.0},
}


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
    noise: tuple[float, float] | None = None  # Gumbel/logistic noise scale, start -> end (linear); None: the pattern's
    prior: float | None = None  # initial logit of the one-shot 2:4 choice of each group (others 0); None: the pattern's
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
            if getattr(self, name) is None and name in PATTERN_DEFAULTS["2:4"]:
                continue
            v = float(getattr(self, name))
            if not math.isfinite(v) or v < 0 or (name == "lr" and v == 0):
                raise SparsekitError(f"--{name.replace('_', '-')} must be a {'positive' if name == 'lr' else 'non-negative'} "
                                     f"finite number, got {getattr(self, name)!r}")
            setattr(self, name, v)
        if self.warmup > 1 or self.holdout >= 1:
            raise SparsekitError(f"warmup must be a fraction in [0, 1] and holdout in [0, 1), got {self.warmup}, {self.holdout}")
        for name in ("tau", "noise"):
            if getattr(self, name) is None and name in PATTERN_DEFAULTS["2:4"]:
                continue
            pair = tuple(float(x) for x in getattr(self, name))
            if len(pair) != 2 or not all(math.isfinite(x) and x >= 0 for x in pair) or (name == "tau" and min(pair) <= 0):
                raise SparsekitError(f"{name} schedule must be two {'positive' if name == 'tau' else 'non-negative'} "
                                     f"numbers (start, end), got {getattr(self, name)!r}")
            setattr(self, name, pair)

    def for_pattern(self, pattern) -> "LearnConfig":
        """This config with the settings left at None taken from ``PATTERN_DEFAULTS`` for ``pattern``
        (hybrid tiles, or 2:4 everywhere)."""
        own = PATTERN_DEFAULTS["hybrid" if pattern.is_hybrid else "2:4"]
        return replace(self, **{k: v for k, v in own.items() if getattr(self, k) is None})

    def heldout_windows(self, n: int) -> int:
        """How many of ``n`` calibration windows are held out (the last ones)."""
        return min(n - 1, max(1, round(n * self.holdout))) if self.holdout and n > 1 else 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tau"] = list(self.tau)
        d["noise"] = None if self.noise is None else list(self.noise)
        return d

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a checkpoint to be resumed (the schedule and the optimizer's settings)."""
        keep = ("steps", "lr", "warmup", "holdout", "batch_size", "tau", "noise", "prior", "tile_prior", "reg", "distill")
        return {f.name: self.as_dict()[f.name] for f in fields(self) if f.name in keep}
