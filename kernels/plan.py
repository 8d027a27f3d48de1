"""Launch planning for the TCA-BME kernels: pure functions of shapes and tuning knobs (no numba).

What a launch looks like before anything runs: which kernel and variant, grid, warps per block,
pipeline stages, shared-memory bytes, token chunks, split-K counts, and the shared-memory layout
sizes they are made from (spmm_warp's and spmm.py's kernels import theirs from here). The tuned
choices come from the H100 sweeps (scripts/bench/tune_kernels.py, docs/kernels-notes.md). The launcher
(launch.py) applies them; tests/test_launch_plan.py checks their invariants.
"""
from __future__ import annotations

import math

import torch

from .work import RowsPlan, split_work

# ---- shared-memory layout sizes (both kernels)
XROW = 18                 # uint64 per staged X row: 16 + 2 pad (144 B), conflict-free 4-byte B loads
XROW_BYTES = 8 * XROW
KPER_MAX = 128            # spmm.py: GroupTiles along K per block (offsets staged in shared memory)
BMW = 16                  # spmm_warp: uint64 bitmaps per strip
WBW = 32                  # spmm_warp: uint64 per warp: (half-bitmap word, value offset) table of the step being decoded
MAX_STEPS = 32            # spmm_warp: steps per warp (one per lane holds its offsets)
MAX_WARPS = 32
MAX_N = 64
DENSE_CHUNKS = 129        # 16-byte value chunks a strip can need: 1024 values + a misaligned start

# ---- tuning knobs
# Token counts up to this use the CUDA-core variant (fp32 FMAs) on weights of at most
# CUDA_CORE_MAX_WEIGHTS elements; otherwise the tensor-core one. From the H100 benchmark
# (docs/kernels-notes.md): at N=1 CUDA cores win on the demo model's shapes (576x576: 7.4 vs
# 8.1 us) and lose on 7B-sized ones (4096x4096: 19.6 vs 17.6 us); from N=2 on tensor cores win.
CUDA_CORE_MAX_N = 1
CUDA_CORE_MAX_WEIGHTS = 1 << 21
MAX_NT = 64                # tokens per launch; more are done in chunks of 64
TARGET_BLOCKS = 4 * 132    # split-K aims for about this many blocks (4 waves' worth on an H100)
DYN_SMEM_MAX = 44 * 1024   # dynamic shared memory per block (static use is ~3.7 KB; 48 KB without opt-in)
VCAP_DENSE = 1024 + 2      # values capacity (uint64) that fits any GroupTile

# spmm_warp (every product, unless K exceeds 32 warps x 32 steps of 64 columns, or a caller asks
# for spmm.py): the dynamic shared memory a block may take once opted in past 48 KB (H100: 227 KB).
WARP_SMEM_MAX = 160 * 1024


def warp_slot_words(vch: int, n: int, r: int = 1) -> int:
    """spmm_warp: uint64 words of one stage: values (``vch`` 16-byte chunks) + ``r`` strips' bitmaps + X rows."""
    return 2 * vch + r * BMW + n * XROW


def warp_smem_bytes(nw: int, vch: int, n: int, stages: int, r: int = 1) -> int:
    """spmm_warp: dynamic shared bytes of a block: each warp's ring of ``stages`` slots and its table."""
    return nw * (stages * warp_slot_words(vch, n, r) + r * WBW) * 8


def warp_max_registers(n: int, r: int = 1) -> int:
    """spmm_warp: register cap per thread (64 keeps 2+ blocks of 8-16 warps on an SM at decode sizes)."""
    if r == 4:
        return 128
    return 64 if n <= 16 and r == 1 else (96 if n <= 16 else 128)


def vcap(w, capturing: bool = False) -> int:
    """uint64 words a stage of spmm.py needs for the largest GroupTile's values (+2 over-read slack).

    Reading it costs a device->host copy, so the launcher does it once per weight (the first, eager
    call); inside CUDA-graph capture (``capturing``) an unseen weight gets the dense capacity instead.
    """
    if capturing:
        return VCAP_DENSE
    longest = int(w.gtile_offsets.diff().max()) if w.gtile_offsets.numel() > 1 else 0
    return min(VCAP_DENSE, longest // 4 + 2)


def strip_chunks(w, r: int = 1, capturing: bool = False) -> int:
    """16-byte value chunks the widest run of ``r`` strips (s = 0, r, ..) of the packed weight ``w``
    spans (whole chunks are copied); inside CUDA-graph capture the dense count."""
    if capturing:
        return r * DENSE_CHUNKS
    so = w.strip_offsets.view(-1, 4).long()
    if so.numel() == 0:
        return 1
    ends = torch.cat([so[:, 1:], w.gtile_offsets[1:].long().view(-1, 1)], 1)
    starts, ends = so[:, 0::r], ends[:, r - 1::r]
    return max(1, min(r * DENSE_CHUNKS, int(((ends + 7) // 8 - starts // 8).max())))


def warp_strips(m: int, gk: int, n: int, sms: int = 132) -> int:
    """Strips per warp-step for spmm_warp: 2 (two strip rows share each X slice, the scan and the
    loop) from 128 strip rows on; small M keeps 1, where halving the blocks costs more than it saves.
    4 (a whole GroupTile row per block: contiguous 4-strip reads, X shared 4 ways) up to 16 tokens
    once that still leaves 1.5 blocks per SM (H100 sweep, docs/kernels-notes.md v9: 14336x4096 and
    22016x4096 gain 4-18%; 11008x4096, 1.3 blocks per SM, loses 15-30%)."""
    rows = -(-m // 16)
    if rows < 128:
        return 1
    return 4 if n <= 16 and -(-rows // 4) * 2 >= 3 * sms and gk < 128 else 2


def warp_plan(m: int, gk: int, n: int, vch: int, warps: int | None = None,
              stages: int | None = None, r: int = 1, sms: int = 132,
              smem_limit: int = WARP_SMEM_MAX) -> tuple[int, int, int]:
    """(warps per block, stages, dynamic shared bytes) for spmm_warp.

    Warps split K inside a block (one block per ``r`` strip rows), at most 32 steps each (their
    offsets live in one register per lane). From the H100 sweeps (scripts/bench/tune_kernels.py,
    docs/kernels-notes.md v6-v8): one step per warp when K is short (<= 16 GroupTiles). With
    r = 2: on tall weights (at least 2 blocks per SM, K < 128 GroupTiles) 4 warps of 16 steps and
    2 stages (6 warps and 3 stages below 8 tokens once the blocks exceed 4 per SM); otherwise 8
    warps (16 when K has >= 128 GroupTiles) and 2 stages (3 from 8 tokens on when K is long).
    With r = 1: below 8 tokens 8 warps (16) and 2 stages, from 8 tokens on 6 warps (12) and 3.
    Stages, then warps, are cut until the block fits ``smem_limit`` bytes.
    """
    blocks = -(-(-(-m // 16)) // r)
    long_k = gk >= 128
    tall = r == 2 and not long_k and gk > 16 and blocks >= 2 * sms
    crowded = tall and n < 8 and blocks > 4 * sms
    if r == 4:     # a whole GroupTile row per block
        warps = warps or (min(gk, 16) if long_k or gk <= 16 else 4)
        stages = stages or 2
    if warps is None:
        if gk <= 16:
            warps = gk
        elif tall:
            warps = 6 if crowded else 4
        elif r == 2 or n < 8:
            warps = 16 if long_k else 8
        else:
            warps = 12 if long_k else 6
    if stages is None:
        if tall:
            stages = 3 if crowded else 2
        else:
            stages = 2 if (n < 8 or (r == 2 and not long_k)) else 3
    need = -(-gk // MAX_STEPS)
    # warps per block the register file takes: 32 at 64 registers; above 64, 16 (a 21-warp block
    # at 96 registers failed to launch on an H100 although 21 x 32 x 96 < 65536)
    regs_cap = 32 if warp_max_registers(n, r) <= 64 else 16
    warps = max(need, min(warps, gk, MAX_WARPS, regs_cap))
    while warp_smem_bytes(warps, vch, n, stages, r) > smem_limit and stages > 2:
        stages -= 1
    while warp_smem_bytes(warps, vch, n, stages, r) > smem_limit and warps > need:
        warps -= 1
    return warps, stages, warp_smem_bytes(warps, vch, n, stages, r)


def warp_chunk(m: int, gk: int, n: int, vchs, warps: int | None = None, stages: int | None = None,
               strips: int | None = None, sms: int = 132, smem_limit: int = WARP_SMEM_MAX) -> int:
    """The most tokens (``n``, or ``n`` halved until it fits) that one spmm_warp launch takes on
    this weight: the plan's shared memory must fit ``smem_limit``, which long K (many warps), many
    tokens and wide strips (a weight first seen inside graph capture gets the dense capacity) can
    break. 0: not even one token fits, and spmm.py runs the product."""
    while n >= 1:
        r = strips or warp_strips(m, gk, n, sms)
        if warp_plan(m, gk, n, vchs[r - 1], warps, stages, r, sms, smem_limit)[2] <= smem_limit:
            return n
        n //= 2
    return 0


def warp_blocks(m: int, r: int) -> int:
    """spmm_warp's grid: one block per ``r`` strip rows (16 outputs each)."""
    return -(-(-(-m // 16)) // r)


def choose_splits(gm: int, gk: int) -> int:
    """spmm.py: split-K count so that the grid has ~TARGET_BLOCKS blocks, each with at least 2 steps."""
    want = max(1, min(math.ceil(gk / 2), math.ceil(TARGET_BLOCKS / gm)))
    want = max(want, math.ceil(gk / KPER_MAX))
    kper = math.ceil(gk / want)
    return math.ceil(gk / kper)


def split_plan(gm: int, gk: int, splits: int | None = None) -> tuple[int, int]:
    """spmm.py: (split count, GroupTiles per split) for ``splits`` (None: ``choose_splits``), kept
    within 1..gk and at most KPER_MAX GroupTiles per block."""
    nsplit = splits if splits is not None else choose_splits(gm, gk)
    nsplit = min(max(nsplit, math.ceil(gk / KPER_MAX)), gk)
    kper = math.ceil(gk / nsplit)
    return math.ceil(gk / kper), kper


def cuda_core_max(m: int, gk: int, override: int | None = None) -> int:
    """spmm.py: the most tokens the CUDA-core variant takes on an ``m`` x ``gk`` GroupTile weight."""
    if override is not None:
        return override
    return CUDA_CORE_MAX_N if m * gk * 64 <= CUDA_CORE_MAX_WEIGHTS else 0


def variant(n: int) -> tuple[int, bool]:
    """spmm.py: (token slots, tensor cores?) for a chunk of ``n`` tokens."""
    if n <= CUDA_CORE_MAX_N:
        return n, False
    nt = 8
    while nt < n:
        nt *= 2
    return nt, True


def spmm_stages(slot: int) -> int:
    """spmm.py: pipeline stages for a stage of ``slot`` uint64 words (2, or up to 4 that fit DYN_SMEM_MAX)."""
    return max(s for s in (2, 3, 4) if s == 2 or s * slot * 8 <= DYN_SMEM_MAX)


# ---- spmm_rows (issue 21, runtime v3; opt-in: tcabme_matmul(kernel="rows") or SPARSEKIT_KERNEL=rows)
# Block = 4 warps = one GroupTile row (warp w decodes strip w), one chunk of NT tokens, one range of
# GroupTile columns (split ks of KS). First guesses, not timed on a GPU yet (docs/kernels-notes.md v14).
ROWS_MAX_NT = 64               # tokens per block; more run as further chunks of the same launch
ROWS_MAX_BLOCKS_PER_SM = 4     # splits stop before the launch passes this many blocks per SM ...
ROWS_MIN_STEPS = 16            # ... or a split would cover fewer GroupTile columns than this
ROWS_MAX_STAGES = 4            # the planned ring depth (forced: 2-8)
ROWS_SMEM_MAX = 45 * 1024      # planned dynamic shared memory (4 stages at 16 tokens: 45376 B)
ROWS_SMEM_FORCED = 47 * 1024   # a forced plan may take up to this (48 KB without opt-in, less static)
ROWS_VALUE_BYTES = DENSE_CHUNKS * 16        # a strip's staged values (a dense one, from the 16-byte floor of its start)
ROWS_STRIP_BYTES = ROWS_VALUE_BYTES + BMW * 8   # + its 16 bitmaps
ROWS_TABLE_BYTES = WBW * 8     # one warp's decode table
ROWS_HEADER_BYTES = 16         # per stage: each warp's strip start mod 8 (where its values begin in the slot)


def rows_stage_bytes(nt: int) -> int:
    """One stage of spmm_rows' ring: the X slice (``nt`` rows of XROW_BYTES), then the 4 warps' strips."""
    return nt * XROW_BYTES + 4 * ROWS_STRIP_BYTES


def rows_smem_bytes(nt: int, stages: int) -> int:
    """spmm_rows' dynamic shared bytes: the ring, the 4 tables and the stage headers; at least the
    block's fp32 output tile [nt, 64] (written over the ring at the end)."""
    return max(stages * (rows_stage_bytes(nt) + ROWS_HEADER_BYTES) + 4 * ROWS_TABLE_BYTES, nt * 64 * 4)


def rows_tokens(n: int) -> int:
    """Token rows per block: the smallest of 8, 16, 32, 64 that covers ``n`` (64 past that)."""
    nt = 8
    while nt < min(n, ROWS_MAX_NT):
        nt *= 2
    return nt


def rows_splits(blocks: int, gk: int, sms: int = 132) -> tuple[int, int]:
    """(splits, GroupTile columns per split) for ``blocks`` blocks per split: the largest power of two that
    keeps the launch within ROWS_MAX_BLOCKS_PER_SM blocks per SM and every split at ROWS_MIN_STEPS
    columns or more (sp24_rows' rule, measured there on an H200); no empty split."""
    ks = 1
    while blocks * ks * 2 <= ROWS_MAX_BLOCKS_PER_SM * sms and gk // (ks * 2) >= ROWS_MIN_STEPS:
        ks *= 2
    kper = -(-gk // ks)
    return -(-gk // kper), kper


def rows_stages(nt: int) -> int:
    """The deepest ring (at most ROWS_MAX_STAGES, at least 2) within ROWS_SMEM_MAX."""
    st = ROWS_MAX_STAGES
    while st > 2 and rows_smem_bytes(nt, st) > ROWS_SMEM_MAX:
        st -= 1
    return st


def rows_max_registers(nt: int) -> int:
    """spmm_rows' register cap: 128 (4 blocks of 4 warps per SM)."""
    return 128


def rows_plan(m: int, gk: int, n: int, sms: int = 132, tokens: int | None = None, splits: int | None = None,
              stages: int | None = None) -> RowsPlan:
    """The launch plan (``kernels.work.RowsPlan``, one tile row per block) of spmm_rows for
    ``[n, 64 gk] @ [m, 64 gk]^T``; ``tokens``, ``splits``, ``stages`` force it (ValueError, one line, for
    a plan that cannot run)."""
    if tokens is not None and tokens not in (8, 16, 32, 64):
        raise ValueError(f"spmm_rows tokens={tokens}: 8, 16, 32 or 64")
    if stages is not None and not 2 <= stages <= 8:
        raise ValueError(f"spmm_rows stages={stages}: 2 to 8")
    nt = tokens or rows_tokens(n)
    rb = -(-m // 64)
    chunks = -(-n // nt)
    ks, per, blocks = split_work(rb * chunks, gk, None if splits else rows_splits(rb * chunks, gk, sms), splits)
    st = stages or rows_stages(nt)
    dyn = rows_smem_bytes(nt, st)
    if dyn > ROWS_SMEM_FORCED:
        raise ValueError(f"this spmm_rows plan (tokens {nt}, stages {st}) needs {dyn} bytes of shared memory, "
                         "more than a block may take without opting in (47 KB): fewer stages or tokens")
    return RowsPlan(nt, st, 1, rb, chunks, ks, per, blocks, dyn)
