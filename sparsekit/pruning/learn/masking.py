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
from sparsekit.pruning.learn.choices import CHOICES, MaskLogits, keep_mask, tile_relaxation


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


def draw(logits: dict[str, MaskLogits], sparsity: float, allocation: str, step: int, steps: int, cfg,
         seed: int, device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The straight-through masks of step ``step`` and the sparsity regularizer (a 0-d tensor).

    The regularizer is ``(mean soft tile sparsity - target)^2`` per unit, where a tile's soft
    probability of being 2:4 is ``sigmoid(logit - threshold)``: it keeps the logits centred on the
    threshold that the hard top-k draw sets, so that the relaxed and the hard sparsity agree.
    """
    tau = sch.temperature(step, steps, cfg.tau)
    ns = sch.noise_scale(step, steps, cfg.noise)
    gen = sch.step_generator(seed, step, device)
    pref, gum = {}, {}
    for name, lg in logits.items():  # a fixed order of draws: the same numbers on every resume
        gum[name] = ns * sch.gumbel(lg.groups.shape, gen, device) if ns > 0 else None
        if lg.tiles is not None:
            pref[name] = lg.tiles + (ns * sch.logistic(lg.tiles.shape, gen, device) if ns > 0 else 0.0)
    sparse, thresh = select_tiles(pref, sparsity, allocation) if pref else ({}, {})
    masks = {}
    for name, lg in logits.items():
        gm = lg.group_mask(gum[name], tau)
        ind = tile_relaxation(pref[name], thresh[name], sparse[name], tau) if name in pref else None
        masks[name] = keep_mask(gm, ind, lg.tile)
    reg = torch.zeros((), device=device)
    if pref:
        units = [[n] for n in pref] if allocation == "layer" else [list(pref)]
        target = sparsity / 0.5  # the fraction of tiles that are 2:4
        for names in units:
            soft = torch.cat([torch.sigmoid(logits[n].tiles - thresh[n]).reshape(-1) for n in names])
            reg = reg + (soft.mean() - target) ** 2
        reg = reg / len(units)
    return masks, reg


@torch.no_grad()
def final_masks(logits: dict[str, MaskLogits], sparsity: float, allocation: str) -> dict[str, torch.Tensor]:
    """The learned bool keep-masks: each group's most likely 2:4 choice, and the top tiles by logit."""
    pref = {n: lg.tiles for n, lg in logits.items() if lg.tiles is not None}
    sparse, _ = select_tiles(pref, sparsity, allocation) if pref else ({}, {})
    out = {}
    for name, lg in logits.items():
        onehot = torch.zeros_like(lg.groups).scatter_(-1, lg.hard_group_choice().unsqueeze(-1), 1.0)
        gm = (onehot @ CHOICES.to(onehot.device)).reshape(lg.shape)
        out[name] = keep_mask(gm, sparse[name].float() if name in sparse else None, lg.tile) > 0.5
    return out
