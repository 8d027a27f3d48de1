"""How a tile-row kernel (sp24_rows, spmm_rows) shares its work among blocks: pure, no torch, no numba.

The work of one launch is ``units`` = output tiles (``rb`` row blocks x ``chunks`` token chunks) x ``gk``
tile columns. Either every block runs one **K split** of one output tile (``ks`` splits of ``per``
columns, the last one shorter; ``ks`` = 1: whole tiles), or **stream-K**: contiguous ranges of ``per``
units, output tiles in order and the columns of each in order, one range per block, so that any shape
spreads evenly over the SMs; a block then runs one segment per output tile its range touches. Either
way a tile that several blocks share is summed by the last of them to arrive (``kernels/block.py``,
``make_tile_end``).
"""
from __future__ import annotations

from typing import NamedTuple


class RowsPlan(NamedTuple):
    """One launch of a tile-row kernel."""
    nt: int          # tokens per output tile
    stages: int      # ring depth
    r: int           # tile rows per block
    rb: int          # row blocks
    chunks: int      # token chunks
    ks: int          # K splits of a tile (one segment per block); 0: stream-K
    per: int         # units per block (K split: columns per split)
    blocks: int      # blocks of the launch
    dyn: int         # dynamic shared bytes
    gk: int          # tile columns

    @property
    def tiles(self) -> int:
        return self.rb * self.chunks

    @property
    def units(self) -> int:
        return self.tiles * self.gk

    @property
    def sk(self) -> bool:
        """Stream-K: a block may run several segments (the kernel variant with the segment loop)."""
        return self.ks == 0

    @property
    def partial(self) -> bool:
        """Some output tile is shared by several blocks: the launch needs the workspace and counters."""
        return self.per % self.gk != 0 if self.sk else self.ks > 1

    def workspace_floats(self) -> int:
        """fp32 workspace: two partial tiles per block (its first and its last output tile), if any."""
        return self.blocks * 2 * self.nt * 64 * self.r if self.partial else 1


def split_work(tiles: int, gk: int, rule: tuple[int, int] | None, splits: int | None = None,
               blocks: int | None = None) -> tuple[int, int, int]:
    """(ks, per, blocks): ``blocks`` forces stream-K over that many blocks (at most one per unit), else
    ``splits`` forces a K split, else ``rule`` = (splits, columns per split) of the plan's own rule."""
    if blocks:
        units = tiles * gk
        per = -(-units // max(1, min(blocks, units)))
        return 0, per, -(-units // per)
    if splits:
        per = -(-gk // max(1, min(splits, gk)))
        ks = -(-gk // per)
    else:
        ks, per = rule
    return ks, per, tiles * ks
