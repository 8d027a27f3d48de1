"""Masks applied to frozen linears: a weight parametrization ``W -> W * mask`` and the draw of every
linear's mask for one step (or the final, noise-free one).

The parametrization (``torch.nn.utils.parametrize``) leaves the weights untouched: ``mask = None``
runs the dense model (the teacher of ``--distill``), and removing it gives the original modules back.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.utils import parametrize

from sparsekit.hf.modules import Conv1D
from sparsekit.pruning.learn import schedule as sch
from sparsekit.pruning.learn.allocation import select_tiles
from sparsekit.pruning.learn.choices import MaskBank, apply_tiles, relaxed_choices, tile_relaxation


class MaskedWeight(nn.Module):
    """``weight -> weight * mask`` (``mask`` is [out, in]; transposed for a GPT-2 Conv1D weight)."""

    def __init__(self, transposed: bool):
        super().__init__()
        self.transposed = transposed
        self.mask: torch.Tensor | None = None

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            return weight
        m = self.mask.t() if self.transposed else self.mask
        return weight * m


@contextlib.contextmanager
def masked(linears: dict[str, nn.Module]):
    """Parametrize every linear's weight with a ``MaskedWeight``; yields ``{name: MaskedWeight}``."""
    holders = {}
    try:
        for name, mod in linears.items():
            holders[name] = MaskedWeight(bool(Conv1D) and isinstance(mod, Conv1D))
            parametrize.register_parametrization(mod, "weight", holders[name], unsafe=True)
        yield holders
    finally:
        for name in holders:
            parametrize.remove_parametrizations(linears[name], "weight", leave_parametrized=False)


def set_masks(holders: dict[str, MaskedWeight], masks: dict[str, torch.Tensor] | None) -> None:
    for name, h in holders.items():
        h.mask = None if masks is None else masks[name]


def _select(bank: MaskBank, pref: torch.Tensor, sparsity: float, allocation: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (sparse bool [NT], threshold [NT]) of the top-preference tiles per unit."""
    views = {n: bank.tile_view(n, pref) for n in bank.names}
    sparse, thresh = select_tiles(views, sparsity, allocation)
    flat_sparse = torch.cat([sparse[n].reshape(-1) for n in bank.names])
    flat_thr = torch.cat([thresh[n].reshape(1).expand(views[n].numel()) for n in bank.names])
    return flat_sparse, flat_thr


def _unit_bounds(bank: MaskBank, allocation: str) -> list[tuple[int, int]]:
    if allocation == "layer":
        return [bank.t_slices[n] for n in bank.names]
    return [(0, bank.tiles.numel())]


def draw(bank: MaskBank, sparsity: float, allocation: str, step: int, steps: int, cfg,
         seed: int, device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The straight-through masks {name: [R, C]} of step ``step`` and the sparsity regularizer.

    The regularizer is the mean over units of ``(mean soft tile sparsity - target)^2``, a tile's soft
    probability of being 2:4 being ``sigmoid(logit - threshold)``: it keeps the logits centred on the
    threshold that the hard top-k draw sets, so that the relaxed and the hard sparsity agree.
    """
    tau = sch.temperature(step, steps, cfg.tau)
    ns = sch.noise_scale(step, steps, cfg.noise)
    gen = sch.step_generator(seed, step, device)
    noise = ns * sch.gumbel(bank.groups.shape, gen, device) if ns > 0 else None
    values = relaxed_choices(bank.groups, noise, tau)
    reg = torch.zeros((), device=device)
    if bank.tiles is not None:
        pref = bank.tiles.detach() + (ns * sch.logistic(bank.tiles.shape, gen, device) if ns > 0 else 0.0)
        sparse, thr = _select(bank, pref, sparsity, allocation)
        values = apply_tiles(values, tile_relaxation(bank.tiles + (pref - bank.tiles.detach()), thr, sparse, tau),
                             bank.tile)
        soft = torch.sigmoid(bank.tiles - thr)
        cs = torch.cat([soft.new_zeros(1), soft.cumsum(0)])
        target = sparsity / 0.5  # the fraction of tiles that are 2:4
        devs = [((cs[b] - cs[a]) / (b - a) - target) ** 2 for a, b in _unit_bounds(bank, allocation)]
        reg = torch.stack(devs).mean()
    return {n: bank.element_mask(n, values) for n in bank.names}, reg


@torch.no_grad()
def final_masks(bank: MaskBank, sparsity: float, allocation: str) -> dict[str, torch.Tensor]:
    """The learned bool keep-masks: each group's most likely 2:4 choice, and the top tiles by logit."""
    values = relaxed_choices(bank.groups, None, 1.0)  # forward value: the argmax choice
    if bank.tiles is not None:
        sparse, _ = _select(bank, bank.tiles, sparsity, allocation)
        values = apply_tiles(values, sparse.float(), bank.tile)
    return {n: bank.element_mask(n, values) > 0.5 for n in bank.names}
