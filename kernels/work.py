"""How a tile-row kernel (sp24_rows, spmm_rows) shares its work among blocks: pure, no torch, no numba.

The work of one launch is ``tiles`` output tiles (``rb`` row blocks x ``chunks`` token chunks), each
``gk`` tile columns deep. Every block runs one **K split** of one output tile: ``ks`` splits of ``per``
columns (the last one shorter; ``ks`` = 1: whole tiles), the splits of a tile neighbours in the grid. A
tile that several blocks share is summed by the last of them to arrive (``kernels/block.py``,
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
    ks: int          # K splits of a tile (one per block)
    per: int         # columns per split
    blocks: int      # blocks of the launch
    dyn: int         # dynamic shared bytes

    @property
    def tiles(self) -> int:
        return self.rb * self.chunks

    @property
    def partial(self) -> bool:
        """Some output tile is shared by several blocks: the launch needs the workspace and counters."""
        return self.ks > 1

    def workspace_floats(self) -> int:
        """fp32 workspace for the blocks' partial tiles, if any: block ``b``'s goes to slot ``2b`` of two
        per block (``make_tile_end``)."""
        return self.blocks * 2 * self.nt * 64 * self.r if self.partial else 1


def split_work(tiles: int, gk: int, rule: tuple[int, int] | None, splits: int | None = None) -> tuple[int, int, int]:
    """(ks, per, blocks): ``splits`` forces a K split, else ``rule`` = (splits, columns per split) of the
    plan's own rule."""
    if splits:
        per = -(-gk // max(1, min(splits, gk)))
        ks = -(-gk // per)
    else:
        ks, per = rule
    return ks, per, tiles * ks
