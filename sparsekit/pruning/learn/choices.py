"""The learnable mask of one linear: logits per 64x64 tile (dense or 2:4) and per group of 4 weights
(which 2 of the 6 2:4 choices to keep), and how a mask is drawn from them.

Each group of 4 consecutive inputs of a row has 6 ways to keep 2 weights (``CHOICES``). A group's
logits ``[R, C/4, 6]`` give a categorical distribution over them (MaskLLM); a tile's logit says how
much it prefers 2:4 over dense (PATCH). Drawing a mask (:meth:`MaskLogits.draw`) is straight-through
Gumbel: the forward pass uses a hard sample, ``argmax(logits + noise * g)`` for groups and a top-k of
``tile logit + noise * logistic`` for tiles (exactly the number of 2:4 tiles the allocation asks
for, so every forward pass runs at the target sparsity); the gradient flows through the relaxed
sample ``softmax((logits + noise * g) / tau)`` / ``sigmoid((tile logit + noise * l - threshold) / tau)``.

All of it is pure tensor math on the logits' device; the logits are float32 whatever the model's dtype.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

# the 6 ways of keeping 2 of 4 weights, as keep-vectors [6, 4]
CHOICES = torch.tensor([[1.0 if i in pair else 0.0 for i in range(4)] for pair in itertools.combinations(range(4), 2)])


def choice_index(keep: torch.Tensor) -> torch.Tensor:
    """For a 2:4 keep-mask [R, C] (exactly 2 kept per group of 4): the index [R, C/4] of its choice in ``CHOICES``."""
    r, c = keep.shape
    codes = keep.reshape(r, c // 4, 4).to(torch.int64) @ torch.tensor([1, 2, 4, 8], device=keep.device)
    table = torch.full((16,), -1, dtype=torch.int64, device=keep.device)
    table[(CHOICES.to(keep.device).to(torch.int64) @ torch.tensor([1, 2, 4, 8], device=keep.device))] = torch.arange(6, device=keep.device)
    idx = table[codes]
    if bool((idx < 0).any()):
        raise ValueError("choice_index needs exactly 2 kept weights in every group of 4")
    return idx


def expand_tiles(tiles: torch.Tensor, tile: int) -> torch.Tensor:
    """Per-tile values [R/T, C/T] -> per-element [R, C] (differentiable, unlike a repeat of bools)."""
    return tiles.repeat_interleave(tile, dim=0).repeat_interleave(tile, dim=1)


class MaskLogits(nn.Module):
    """The learnable logits of one [R, C] weight. ``tile`` 0 means pattern 2:4 (no tile logits)."""

    def __init__(self, shape: tuple[int, int], tile: int, device=None):
        super().__init__()
        r, c = shape
        self.shape, self.tile = (int(r), int(c)), int(tile)
        self.groups = nn.Parameter(torch.zeros(r, c // 4, 6, dtype=torch.float32, device=device))
        self.tiles = (nn.Parameter(torch.zeros(r // tile, c // tile, dtype=torch.float32, device=device))
                      if tile else None)

    @torch.no_grad()
    def init_from(self, group_choice: torch.Tensor, sparse_tiles: torch.Tensor | None, prior: float,
                  tile_prior: float) -> None:
        """Logits favouring a given mask: ``prior`` on the chosen 2:4 choice of each group (0 on the
        others), and +/- ``tile_prior`` on tiles chosen sparse / dense."""
        self.groups.zero_()
        self.groups.scatter_(-1, group_choice.unsqueeze(-1).to(self.groups.device), float(prior))
        if self.tiles is not None:
            self.tiles.copy_(torch.where(sparse_tiles.to(self.tiles.device), tile_prior, -tile_prior))

    def group_mask(self, gumbel: torch.Tensor | None, tau: float) -> torch.Tensor:
        """Straight-through 2:4 keep-mask [R, C] (values 0/1, gradient of the relaxed sample)."""
        z = self.groups if gumbel is None else self.groups + gumbel
        soft = torch.softmax(z / tau, dim=-1)
        hard = torch.zeros_like(soft).scatter_(-1, z.argmax(-1, keepdim=True), 1.0)
        y = hard + soft - soft.detach()
        return (y @ CHOICES.to(y.device)).reshape(self.shape)

    def hard_group_choice(self) -> torch.Tensor:
        """The most likely 2:4 choice of every group [R, C/4]."""
        return self.groups.detach().argmax(-1)


def tile_relaxation(z: torch.Tensor, threshold: torch.Tensor, sparse: torch.Tensor, tau: float) -> torch.Tensor:
    """Straight-through tile indicator (1 = 2:4): the forward value is ``sparse``, the gradient that of
    ``sigmoid((z - threshold) / tau)``."""
    soft = torch.sigmoid((z - threshold) / tau)
    return sparse.to(soft.dtype) + soft - soft.detach()


def keep_mask(group_mask: torch.Tensor, tile_ind: torch.Tensor | None, tile: int) -> torch.Tensor:
    """Element keep-mask [R, C]: ``group_mask`` inside 2:4 tiles, 1 in dense tiles."""
    if tile_ind is None:
        return group_mask
    t = expand_tiles(tile_ind, tile)
    return 1.0 - t * (1.0 - group_mask)
