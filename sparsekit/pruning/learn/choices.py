"""The learnable masks: logits per 64x64 tile (dense or 2:4) and per group of 4 weights (which 2 of
the 6 2:4 choices to keep), and how a mask is drawn from them.

Each group of 4 consecutive inputs of a row has 6 ways to keep 2 weights (``CHOICES``). A group's
logits ``[R, C/4, 6]`` give a categorical distribution over them (MaskLLM); a tile's logit says how
much it prefers 2:4 over dense (PATCH). Drawing a mask (``masking.draw``) is straight-through
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
    codes = (keep.reshape(r, c // 4, 4).to(torch.int64) * torch.tensor([1, 2, 4, 8], device=keep.device)).sum(-1)  # (no integer matmul on CUDA)
    table = torch.full((16,), -1, dtype=torch.int64, device=keep.device)
    table[(CHOICES.to(keep.device).to(torch.int64) * torch.tensor([1, 2, 4, 8], device=keep.device)).sum(-1)] = torch.arange(6, device=keep.device)
    idx = table[codes]
    if bool((idx < 0).any()):
        raise ValueError("choice_index needs exactly 2 kept weights in every group of 4")
    return idx


def expand_tiles(tiles: torch.Tensor, tile: int) -> torch.Tensor:
    """Per-tile values [R/T, C/T] -> per-element [R, C]."""
    return tiles.repeat_interleave(tile, dim=0).repeat_interleave(tile, dim=1)


class MaskBank(nn.Module):
    """The learnable logits of every masked linear, in two flat float32 parameters.

    ``groups`` [G, 6]: six logits per group of 4 weights, all linears one after the other. With
    hybrid tiles (``tile`` > 0) the groups of a linear are stored tile by tile (a tile's T x T/4
    groups contiguous), so that a tile's indicator broadcasts over its groups without a gather;
    for 2:4 (``tile`` 0) row by row. ``tiles`` [NT]: one logit per tile, linears one after the other
    (each row-major). Flat parameters keep the number of kernels per step independent of the number
    of linears; ``group_view`` / ``tile_view`` give one linear's part in its own [R, ...] layout.
    """

    def __init__(self, shapes: dict[str, tuple[int, int]], tile: int, device=None):
        super().__init__()
        self.names, self.tile = list(shapes), int(tile)
        self.shapes = {n: (int(r), int(c)) for n, (r, c) in shapes.items()}
        self.g_slices, self.t_slices = {}, {}
        g = t = 0
        for n, (r, c) in self.shapes.items():
            self.g_slices[n] = (g, g + r * c // 4)
            g += r * c // 4
            if tile:
                self.t_slices[n] = (t, t + (r // tile) * (c // tile))
                t += (r // tile) * (c // tile)
        self.groups = nn.Parameter(torch.zeros(g, 6, dtype=torch.float32, device=device))
        self.tiles = nn.Parameter(torch.zeros(t, dtype=torch.float32, device=device)) if tile else None

    def tile_grid(self, name: str) -> tuple[int, int]:
        r, c = self.shapes[name]
        return r // self.tile, c // self.tile

    def to_bank(self, name: str, per_group: torch.Tensor) -> torch.Tensor:
        """One linear's per-group values [R, C/4, ...] -> its flat bank order [R*C/4, ...]."""
        if not self.tile:
            return per_group.reshape(-1, *per_group.shape[2:])
        nr, nc = self.tile_grid(name)
        t, rest = self.tile, per_group.shape[2:]
        x = per_group.reshape(nr, t, nc, t // 4, *rest).transpose(1, 2)
        return x.reshape(-1, *rest)

    def element_mask(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """One linear's [R, C] mask from the bank-ordered per-element values ``flat`` [G, 4]."""
        a, b = self.g_slices[name]
        r, c = self.shapes[name]
        part = flat[a:b]
        if not self.tile:
            return part.reshape(r, c)
        nr, nc = self.tile_grid(name)
        return part.reshape(nr, nc, self.tile, self.tile).transpose(1, 2).reshape(r, c)

    def tile_view(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        a, b = self.t_slices[name]
        return flat[a:b].reshape(self.tile_grid(name))

    @torch.no_grad()
    def init_from(self, name: str, group_choice: torch.Tensor, sparse_tiles: torch.Tensor | None, prior: float,
                  tile_prior: float, tile_bias: torch.Tensor | None = None) -> None:
        """Logits of linear ``name`` favouring a mask: ``prior`` on each group's chosen 2:4 choice
        [R, C/4] (0 on the others); +/- ``tile_prior`` on tiles chosen 2:4 / dense, plus ``tile_bias``."""
        a, b = self.g_slices[name]
        g = self.groups[a:b]
        g.zero_()
        g.scatter_(-1, self.to_bank(name, group_choice.to(g.device)).unsqueeze(-1), float(prior))
        if self.tiles is not None:
            t = torch.where(sparse_tiles.to(self.tiles.device), tile_prior, -tile_prior)
            if tile_bias is not None:
                t = t + tile_bias.to(t.device)
            self.tiles[slice(*self.t_slices[name])] = t.reshape(-1)


def relaxed_choices(groups: torch.Tensor, noise: torch.Tensor | None, tau: float) -> torch.Tensor:
    """Straight-through per-element keep values [G, 4] of the groups' sampled 2:4 choices."""
    z = groups if noise is None else groups + noise
    soft = torch.softmax(z / tau, dim=-1)
    hard = torch.zeros_like(soft).scatter_(-1, z.argmax(-1, keepdim=True), 1.0)
    return (hard + soft - soft.detach()) @ CHOICES.to(soft.device)


def tile_relaxation(z: torch.Tensor, threshold: torch.Tensor, sparse: torch.Tensor, tau: float) -> torch.Tensor:
    """Straight-through tile indicator (1 = 2:4): the forward value is ``sparse``, the gradient that of
    ``sigmoid((z - threshold) / tau)``."""
    soft = torch.sigmoid((z - threshold) / tau)
    return sparse.to(soft.dtype) + soft - soft.detach()


def apply_tiles(choices: torch.Tensor, indicator: torch.Tensor, tile: int) -> torch.Tensor:
    """Bank-ordered keep values [G, 4]: the 2:4 ``choices`` inside 2:4 tiles (``indicator`` [NT] = 1),
    1 in dense tiles (tile-major bank: each tile's T*T/4 groups are contiguous)."""
    per_tile = choices.reshape(indicator.numel(), tile * tile // 4, 4)
    return (1.0 - indicator[:, None, None] * (1.0 - per_tile)).reshape(-1, 4)
