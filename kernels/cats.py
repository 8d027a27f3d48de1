"""Activation-sparse (CATS) gated MLP at decode: host side of ``cats_up`` and ``cats_down``.

    h = cats_up(g, x, up, threshold)      # h[N, I] = t(act(g)) * (x @ up^T), active neurons only
    y = cats_down(h, down_t)              # y[N, H] = h @ down_t, active neurons' rows only

``g`` = gate(x) (fp16 ``[N, I]``, any linear computed it), ``x`` fp16 ``[N, H]``, ``threshold`` a
float32 tensor of one element (the MLP's CATS threshold), ``t(a)`` = ``a`` where ``|a| >= threshold``
else 0 (``sparsekit.pruning.methods.cats.threshold_activation``). ``up`` is up's weight ``[I, H]``
(dense fp16, contiguous) or row-packed (``sparsekit.packed.rowpack.RowPacked``); ``down_t`` is
down's weight transposed, either tiled by ``tile_down`` (dense) or row-packed. N is 1 to ``MAX_TOKENS``. Both launch on torch's current
stream with no host sync, so a CUDA graph can capture them (after one eager call per token count,
which compiles); under ``NUMBA_ENABLE_CUDASIM=1`` CPU tensors run through the simulator.
"""
from __future__ import annotations

import torch

from sparsekit.packed.rowpack import RowPacked

from .common import SIM

MAX_TOKENS = 8
UP_WARPS = 4          # warps (neurons) per up block
DOWN_TILE = 128       # columns per tile of dense down^T (128 v: v words per lane)
DOWN_THREADS = 64 if SIM else 256    # threads per dense down block: 8 warps sharing 128 output columns
DOWN_WARPS = 2 if SIM else 4         # warps per row-packed down block (sharing 4 groups of 256 columns)

def token_bucket(n: int, rows: bool = False) -> int:
    """The compiled token count serving ``n`` tokens (1, 2, 4 or 8; row-packed weights: 1 or 2)."""
    from .cats_kernels import ROWS_MAX_TOKENS

    top = ROWS_MAX_TOKENS if rows else MAX_TOKENS
    if not 1 <= n <= top:
        raise ValueError(f"the CATS kernels take 1 to {top} tokens{' on row-packed weights' if rows else ''}, got {n}")
    return 1 if n == 1 else 2 if n == 2 else 4 if n <= 4 else 8


def tile_down(down_t: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """``down^T`` ([I, H], dense fp16) in the tiled layout ``cats_down`` reads: [ceil(H / width), I,
    width] (``width`` a multiple of 128, default ``DOWN_TILE``), zero-padded columns."""
    width = width or DOWN_TILE
    i, hid = down_t.shape
    cb = -(-hid // width)
    padded = torch.zeros((i, cb * width), dtype=down_t.dtype, device=down_t.device)
    padded[:, :hid] = down_t
    return padded.view(i, cb, width).permute(1, 0, 2).contiguous()


def _check(name, t, shape, dtype=torch.float16):
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {tuple(shape)}, "
                         f"got {tuple(t.shape)} {t.dtype}")


def cats_up(g: torch.Tensor, x: torch.Tensor, up, threshold: torch.Tensor, out: torch.Tensor | None = None,
            *, warps: int | None = None, rows_per_warp: int = 0, unroll: int = 0) -> torch.Tensor:
    """``h[N, I]``: thresholded SiLU(g) times ``x @ up^T``, computed for active neurons only
    (``warps``, ``rows_per_warp``, ``unroll``: tuning knobs for benchmarks)."""
    from . import launch
    from .cats_up import get_up
    n, i = g.shape
    h_in = x.shape[1]
    rows = isinstance(up, RowPacked)
    if tuple(up.shape) != (i, h_in):
        raise ValueError(f"up must be [{i}, {h_in}], got {tuple(up.shape)}")
    if h_in % 8:
        raise ValueError(f"the CATS kernels need a hidden size divisible by 8, got {h_in}")
    _check("g", g, (n, i))
    _check("x", x, (n, h_in))
    if out is None:
        out = torch.empty((n, i), dtype=torch.float16, device=g.device)
    _check("out", out, (n, i))
    kern = get_up(token_bucket(n, rows), rows, rows_per_warp, unroll)
    from .cats_up import UP_ROWS

    wpb = warps or (1 if SIM and rows else UP_WARPS)
    blocks = -(-i // (wpb * (1 if rows else (rows_per_warp or UP_ROWS))))
    thr = threshold.reshape(1).to(torch.float32)
    common = (g.reshape(-1).view(torch.int16), x.reshape(-1).view(torch.int64))
    if rows:
        tensors = (*common, up.masks.reshape(-1).view(torch.uint32), up.values.view(torch.int16), up.goff, thr,
                   out.view(-1).view(torch.int16))
        scalars = (i, h_in // 4, n, up.groups)
    else:
        _check("up", up, (i, h_in))
        tensors = (*common, up.reshape(-1).view(torch.int64), thr, out.view(-1).view(torch.int16))
        scalars = (i, h_in // 4, n)
    launch.launch_tensors(kern, blocks, 32 * wpb, tensors, scalars)
    return out


def down_plan(i: int, cb: int, sms: int, splits: int | None = None, nt: int = 1) -> tuple[int, int]:
    """(chunk size, chunks) for ``i`` neurons over ``cb`` column blocks: about 4 blocks per SM,
    chunks of at most ``jmax(nt)`` neurons."""
    from .cats_down import jmax

    top = jmax(nt)
    if splits is None:
        splits = max(-(-i // top), min(-(-4 * sms // cb), -(-i // 32)))
    jc = min(top, -(-i // max(1, splits)))
    return jc, -(-i // jc)


def cats_down(h: torch.Tensor, down_t, out: torch.Tensor | None = None, *, splits: int | None = None,
              threads: int | None = None, unroll: int = 0, regs: int = 0) -> torch.Tensor:
    """``y[N, H] = h @ down_t`` reading only the rows of ``down_t`` whose ``h`` column is nonzero."""
    from . import launch
    from .cats_down import get_down

    n, i = h.shape
    rows = isinstance(down_t, RowPacked)
    if rows:
        if down_t.shape[0] != i:
            raise ValueError(f"down_t must have {i} rows (the neurons), got {tuple(down_t.shape)}")
        hid = down_t.shape[1]
    else:   # tiled (tile_down): [blocks, I, 128]; the hidden size comes from out, else blocks * 128
        if down_t.dim() != 3 or down_t.shape[1] != i or down_t.shape[2] % 128 or down_t.shape[2] > 512:
            raise ValueError(f"down_t must be tile_down's [blocks, {i}, 128 v], got {tuple(down_t.shape)}")
        hid = out.shape[1] if out is not None else down_t.shape[0] * down_t.shape[2]
    if hid % 8:
        raise ValueError(f"the CATS kernels need a hidden size divisible by 8, got {hid}")
    _check("h", h, (n, i))
    if out is None:
        out = torch.empty((n, hid), dtype=torch.float16, device=h.device)
    _check("out", out, (n, hid))
    kern = get_down(token_bucket(n, rows), rows, unroll, regs, 1 if rows else down_t.shape[2] // 128)
    if rows:
        threads = 32 * DOWN_WARPS
        cb = down_t.groups // 4
    else:
        if down_t.shape[0] != -(-hid // down_t.shape[2]) or not down_t.is_contiguous():
            raise ValueError(f"down_t has {down_t.shape[0]} column blocks of {down_t.shape[2]}: not {hid} columns")
        threads = threads or DOWN_THREADS
        cb = down_t.shape[0]
    jc, s = down_plan(i, cb, launch.sm_count(h.device), splits, token_bucket(n, rows))
    ws, cnt = launch.workspace(h.device, s * token_bucket(n, rows) * hid if s > 1 else 1, cb)
    hv, yv = h.reshape(-1).view(torch.int16), out.view(-1).view(torch.int16)
    if rows:
        tensors = (hv, down_t.masks.reshape(-1).view(torch.uint32), down_t.values.view(torch.int16), down_t.goff, yv, ws, cnt)
        scalars = (i, hid, n, jc, s, down_t.groups, cb)
    else:
        tensors = (hv, down_t.reshape(-1).view(torch.int64), yv, ws, cnt)
        scalars = (i, hid // 4, n, jc, s, cb)
    launch.launch_tensors(kern, cb * s, threads, tensors, scalars)
    return out
