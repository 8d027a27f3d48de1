"""The annealing schedule of a learning run and the per-step random draws.

Temperature falls geometrically from ``tau[0]`` to ``tau[1]``; the noise scale linearly from
``noise[0]`` to ``noise[1]`` (exploration early, the learned logits alone at the end). Every random
draw of step ``t`` comes from generators seeded with ``(seed, t)`` only, so a run resumed at any
step draws exactly what the uninterrupted run drew.
"""
from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: step seeds of different seeds do not collide


def progress_fraction(step: int, steps: int) -> float:
    return step / (steps - 1) if steps > 1 else 1.0


def temperature(step: int, steps: int, tau: tuple[float, float]) -> float:
    f = progress_fraction(step, steps)
    return float(tau[0] * (tau[1] / tau[0]) ** f)


def noise_scale(step: int, steps: int, noise: tuple[float, float]) -> float:
    f = progress_fraction(step, steps)
    return float(noise[0] + (noise[1] - noise[0]) * f)


def step_seed(seed: int, step: int) -> int:
    return (int(seed) * _MIX + int(step) + 1) % (2**63)


def step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(step_seed(seed, step))
    return g


def batch_indices(seed: int, step: int, n: int, batch_size: int) -> torch.Tensor:
    """The calibration windows of step ``step`` (a CPU draw: the same on every device)."""
    g = step_generator(seed ^ 0x5EED, step, torch.device("cpu"))
    return torch.randperm(n, generator=g)[: min(batch_size, n)]


def gumbel(shape, gen: torch.Generator, device) -> torch.Tensor:
    u = torch.rand(shape, generator=gen, device=device).clamp_(1e-10, 1 - 1e-7)
    return -torch.log(-torch.log(u))


def logistic(shape, gen: torch.Generator, device) -> torch.Tensor:
    u = torch.rand(shape, generator=gen, device=device).clamp_(1e-7, 1 - 1e-7)
    return torch.log(u) - torch.log1p(-u)


def describe(steps: int, tau: tuple[float, float], noise: tuple[float, float]) -> dict:
    """The schedule as recorded in sparsekit.json."""
    return {"temperature": {"start": tau[0], "end": tau[1], "shape": "geometric"},
            "noise": {"start": noise[0], "end": noise[1], "shape": "linear"}, "steps": steps}
