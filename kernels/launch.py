"""Host side: torch tensors -> kernel launch on torch's current stream (CUDA-graph capturable).

Everything here is cheap enough to run inside ``torch.cuda.graph`` capture: no synchronization,
no host<->device copies; workspaces are cached per device and only grow. Numba compiles each kernel
variant at its first launch, so warm up (one eager call per token count) before capturing.
"""
from __future__ import annotations

import ctypes
import math

import torch
from numba import config as numba_config
from numba import cuda

from . import spmm, spmm_warp
from ._intrinsics import SIM

# Split-K grids for small layers are deliberately small; numba's "grid size N will likely result in
# GPU under-utilization" warning fires on every such launch and floods the user's terminal.
numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = False
try:  # numba-cuda (the separate package) reads its own copy of the config
    from numba.cuda.core import config as _numba_cuda_config

    _numba_cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = False
except ImportError:
    pass

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
_SMEM_OPTIN_OK: bool | None = None
_optin_done: set = set()

_streams: dict = {}
_work: dict = {}
_views: dict = {}
_sms: dict = {}
_fast: dict = {}      # (id(kernel), device index) -> cuda.core kernel, or None where the fast launch is off
_cfgs: dict = {}
_VIEW_CACHE_MAX = 4096


def _as_numba(t: torch.Tensor):
    """A numba device array over ``t``'s memory (no copy, no stream sync)."""
    if SIM:
        return t.detach().numpy()
    return cuda.from_cuda_array_interface(t.__cuda_array_interface__, owner=t, sync=False)


def _stream(device: torch.device):
    s = torch.cuda.current_stream(device)
    key = s.cuda_stream
    if key not in _streams:
        _streams[key] = cuda.external_stream(key)
    return _streams[key]


def _vcap(w) -> int:
    """uint64 words a stage needs for the largest GroupTile's values (+2 over-read slack).

    Reading it costs a device->host copy, so it is done once per weight (the first, eager call);
    inside CUDA-graph capture an unseen weight gets the dense capacity instead.
    """
    if not SIM and torch.cuda.is_current_stream_capturing():
        return VCAP_DENSE
    longest = int(w.gtile_offsets.diff().max()) if w.gtile_offsets.numel() > 1 else 0
    return min(VCAP_DENSE, longest // 4 + 2)


def clear_caches() -> None:
    """Forget the cached device views of packed weights (they keep the weights' memory alive)."""
    _views.clear()


def _strip_chunks(w, r: int = 1) -> int:
    """16-byte value chunks the widest run of ``r`` strips (s = 0, r, ..) spans (whole chunks are copied)."""
    if not SIM and torch.cuda.is_current_stream_capturing():
        return r * spmm_warp.DENSE_CHUNKS
    so = w.strip_offsets.view(-1, 4).long()
    if so.numel() == 0:
        return 1
    ends = torch.cat([so[:, 1:], w.gtile_offsets[1:].long().view(-1, 1)], 1)
    starts, ends = so[:, 0::r], ends[:, r - 1::r]
    return max(1, min(r * spmm_warp.DENSE_CHUNKS, int(((ends + 7) // 8 - starts // 8).max())))


def _weight_views(w):
    """Numba views of the packed weight's tensors + its stage capacity, cached by address."""
    key = (w.bitmaps.data_ptr(), w.values.data_ptr(), w.gtile_offsets.data_ptr(),
           w.strip_offsets.data_ptr(), w.values.numel(), w.bitmaps.numel())
    v = None if SIM else _views.get(key)
    if v is None:
        # the kernel reads values through the offsets (a multiple of 8 each): a padded tail is
        # never read, so trim it to whole 8-byte words; bulk copies need a 16-byte aligned base
        values = w.values[: w.values.numel() // 8 * 8]
        if values.data_ptr() % 16:
            values = values.clone()
        arrays = (_as_numba(w.bitmaps.view(torch.int64)), _as_numba(values.view(torch.int64)),
                  _as_numba(w.gtile_offsets), _as_numba(w.strip_offsets))
        flat = [] if SIM else [f for a in arrays for f in _flat(a.device_ctypes_pointer.value or 0, a.size, a.dtype.itemsize)]
        v = arrays + (_vcap(w), (_strip_chunks(w, 1), _strip_chunks(w, 2), 0, _strip_chunks(w, 4)), flat)
        if not SIM:
            if len(_views) >= _VIEW_CACHE_MAX:
                _views.clear()
            _views[key] = v
    return v


def _workspace(device: torch.device, floats: int, rows: int):
    """fp32 split-K partials and the per-row arrival counters (zeroed once, reset by the kernel)."""
    key = str(device)
    ws, cnt = _work.get(key, (None, None))
    if ws is None or ws.numel() < floats:
        ws = torch.empty(max(floats, 1 << 16), dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < rows:
        cnt = torch.zeros(max(rows, 1024), dtype=torch.int32, device=device)
    _work[key] = (ws, cnt)
    return ws, cnt


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
              stages: int | None = None, r: int = 1, sms: int = 132) -> tuple[int, int, int]:
    """(warps per block, stages, dynamic shared bytes) for spmm_warp.

    Warps split K inside a block (one block per ``r`` strip rows), at most 32 steps each (their
    offsets live in one register per lane). From the H100 sweeps (scripts/tune_kernels.py,
    docs/kernels-notes.md v6-v8): one step per warp when K is short (<= 16 GroupTiles). With
    r = 2: on tall weights (at least 2 blocks per SM, K < 128 GroupTiles) 4 warps of 16 steps and
    2 stages (6 warps and 3 stages below 8 tokens once the blocks exceed 4 per SM); otherwise 8
    warps (16 when K has >= 128 GroupTiles) and 2 stages (3 from 8 tokens on when K is long).
    With r = 1: below 8 tokens 8 warps (16) and 2 stages, from 8 tokens on 6 warps (12) and 3.
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
    need = -(-gk // spmm_warp.MAX_STEPS)
    # warps per block the register file takes: 32 at 64 registers; above 64, 16 (a 21-warp block
    # at 96 registers failed to launch on an H100 although 21 x 32 x 96 < 65536)
    regs_cap = 32 if spmm_warp.max_registers(n, r) <= 64 else 16
    warps = max(need, min(warps, gk, spmm_warp.MAX_WARPS, regs_cap))
    limit = _smem_limit()
    while spmm_warp.smem_bytes(warps, vch, n, stages, r) > limit and stages > 2:
        stages -= 1
    while spmm_warp.smem_bytes(warps, vch, n, stages, r) > limit and warps > need:
        warps -= 1
    return warps, stages, spmm_warp.smem_bytes(warps, vch, n, stages, r)


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached; 132, an H100's, under the simulator)."""
    if SIM:
        return 132
    key = str(device)
    if key not in _sms:
        _sms[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sms[key]


def _smem_limit() -> int:
    return WARP_SMEM_MAX if _SMEM_OPTIN_OK is not False else DYN_SMEM_MAX


def _allow_smem(kern, args, dyn: int) -> bool:
    """Let the kernel take up to WARP_SMEM_MAX of dynamic shared memory (past the default 48 KB)."""
    global _SMEM_OPTIN_OK
    if dyn <= 48 * 1024 or id(kern) in _optin_done:
        return True
    try:
        from numba.cuda.cudadrv.driver import binding, driver

        k = kern._compile_for_args(*args)
        cufunc = k._codelibrary.get_cufunc()
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, WARP_SMEM_MAX, cufunc.handle, cufunc.device.id)
        _optin_done.add(id(kern))
        _SMEM_OPTIN_OK = True
        return True
    except Exception:  # noqa: BLE001 - an older numba: stay under 48 KB
        _SMEM_OPTIN_OK = False
        return False


def warp_chunk(m: int, gk: int, n: int, vchs, warps: int | None = None, stages: int | None = None,
               strips: int | None = None, sms: int = 132) -> int:
    """The most tokens (``n``, or ``n`` halved until it fits) that one spmm_warp launch takes on
    this weight: the plan's shared memory must fit, which long K (many warps), many tokens and
    wide strips (a weight first seen inside graph capture gets the dense capacity) can break.
    0: not even one token fits, and spmm.py runs the product."""
    limit = _smem_limit()
    while n >= 1:
        r = strips or warp_strips(m, gk, n, sms)
        if warp_plan(m, gk, n, vchs[r - 1], warps, stages, r, sms)[2] <= limit:
            return n
        n //= 2
    return 0


def _flat(ptr: int, size: int, itemsize: int) -> list:
    """A 1-D contiguous device array as numba passes it to a kernel: meminfo, parent, item count,
    item size, data pointer, shape, strides."""
    return [0, 0, size, itemsize, ptr, size, itemsize]


def _fast_entry(kern, args):
    """The cuda.core kernel behind ``kern`` if launching it directly passes exactly the arguments
    numba's own launch would (checked once per kernel against numba's argument packing); else None.
    ``args``: numba device arrays (1-D, contiguous) first, then int64 scalars.

    numba's launch (type checks, a device-array wrapper per tensor) costs ~0.3 ms per call from
    Python, 25x this kernel at decode shapes; it matters wherever the product is not replayed
    from a CUDA graph (prefill, eager decode).
    """
    try:
        ck = kern._compile_for_args(*args)
        ref: list = []
        for t, v in zip(ck.argument_types, args):
            ck._prepare_args(t, v, 0, [], ref)
        mine: list = []
        for a in args:
            if hasattr(a, "device_ctypes_pointer"):
                mine += _flat(a.device_ctypes_pointer.value or 0, a.size, a.dtype.itemsize)
            else:
                mine.append(ctypes.c_int64(a))
        same = [getattr(a, "value", a) for a in ref] == [getattr(a, "value", a) for a in mine]
        return ck._codelibrary.get_cufunc().kernel if same else None
    except Exception:  # noqa: BLE001 - another numba: keep its own launch
        return None


def _launch_direct(ck, blocks: int, threads: int, dyn: int, stream, flat, scalars) -> None:
    """Launch the cuda.core kernel ``ck`` with numba's argument packing: ``flat`` (the arrays, see
    ``_flat``) then ``scalars`` as int64."""
    from cuda.core import LaunchConfig
    from cuda.core import launch as cc_launch

    key = (blocks, threads, dyn)
    cfg = _cfgs.get(key)
    if cfg is None:
        cfg = _cfgs[key] = LaunchConfig(grid=blocks, block=threads, shmem_size=dyn)
    cc_launch(stream, cfg, ck, *flat, *[ctypes.c_int64(s) for s in scalars])


def launch_tensors(kern, blocks: int, threads: int, tensors, scalars) -> None:
    """Launch ``kern[blocks, threads]`` on torch's current stream with 1-D contiguous tensors (as
    numba arrays) then int64 scalars, directly once numba's packing of them is checked (no dynamic
    shared memory)."""
    device = tensors[0].device
    if SIM:
        kern[blocks, threads](*[_as_numba(t) for t in tensors], *scalars)
        return
    fkey = (id(kern), device.index)
    ck = _fast.get(fkey)
    if ck is not None:
        flat = [f for t in tensors for f in _flat(t.data_ptr(), t.numel(), t.element_size())]
        _launch_direct(ck, blocks, threads, 0, _stream(device), flat, scalars)
        return
    args = tuple(_as_numba(t) for t in tensors) + tuple(scalars)
    kern[blocks, threads, _stream(device)](*args)
    if fkey not in _fast:
        _fast[fkey] = _fast_entry(kern, args)


def _launch_warp(x, w, y, bm, vals, goff, soff, vchs, warps, stages, strips, regs=None, wflat=None) -> bool:
    """One spmm_warp launch for all of x's rows; False (nothing launched) if its plan cannot get
    the shared memory it needs."""
    n = x.shape[0]
    m, _ = w.shape
    gm, gk = w.grid
    sms = _sm_count(x.device)
    r = strips or warp_strips(m, gk, n, sms)
    vch = vchs[r - 1]
    nw, st, dyn = warp_plan(m, gk, n, vch, warps, stages, r, sms)
    cmax = -(-vch // 32)
    kern = spmm_warp.get_kernel(n, st, cmax, r, regs)
    scalars = (m, gk, gk * 128, vch, spmm_warp.slot_words(vch, n, r))
    blocks = -(-(-(-m // 16)) // r)
    fkey = (id(kern), x.device.index)
    # (a block past 48 KB of shared memory needs the kernel's opt-in first: numba's launch path does it)
    if not SIM and wflat and _fast.get(fkey) is not None and (dyn <= 48 * 1024 or id(kern) in _optin_done):
        xs, ys = x.numel() // 4, y.numel()     # x as int64 words, y as int16
        _launch_direct(_fast[fkey], blocks, 32 * nw, dyn, _stream(x.device),
                       [*wflat, *_flat(x.data_ptr(), xs, 8), *_flat(y.data_ptr(), ys, 2)], scalars)
        return True
    xv = _as_numba(x.reshape(-1).view(torch.int64))
    yv = _as_numba(y.reshape(-1).view(torch.int16))
    args = (bm, vals, goff, soff, xv, yv) + scalars
    if SIM:
        kern[blocks, 32 * nw, 0, dyn](*args)
        return True
    if not _allow_smem(kern, args, dyn):
        nw, st, dyn = warp_plan(m, gk, n, vch, warps, stages, r, sms)   # now under 48 KB
        if dyn > _smem_limit():
            return False
        kern = spmm_warp.get_kernel(n, st, cmax, r, regs)
    kern[blocks, 32 * nw, _stream(x.device), dyn](*args)
    fkey = (id(kern), x.device.index)
    if fkey not in _fast:
        _fast[fkey] = _fast_entry(kern, args)
    return True


def choose_splits(gm: int, gk: int) -> int:
    """Split-K count so that the grid has ~TARGET_BLOCKS blocks, each with at least 2 steps."""
    want = max(1, min(math.ceil(gk / 2), math.ceil(TARGET_BLOCKS / gm)))
    want = max(want, math.ceil(gk / spmm.KPER_MAX))
    kper = math.ceil(gk / want)
    return math.ceil(gk / kper)


def variant(n: int) -> tuple[int, bool]:
    """(token slots, tensor cores?) for a chunk of ``n`` tokens."""
    if n <= CUDA_CORE_MAX_N:
        return n, False
    nt = 8
    while nt < n:
        nt *= 2
    return nt, True


def launch(x: torch.Tensor, w, y: torch.Tensor, *, splits: int | None = None,
           cuda_core_max_n: int | None = None, warp_kernel: bool | None = None,
           warps: int | None = None, stages: int | None = None, strips: int | None = None,
           regs: int | None = None) -> None:
    """y[N, M] = x[N, Kp] @ W^T; x already padded to Kp columns, contiguous, 16-byte aligned."""
    n_all = x.shape[0]
    m, _ = w.shape
    gm, gk = w.grid
    kp = gk * 64
    bm, vals, goff, soff, vcap, vch, wflat = _weight_views(w)
    # spmm_warp unless K needs more warps than a block's register file holds (K > 32768 columns)
    fits = gk <= spmm_warp.MAX_STEPS * 16
    if warp_kernel is not False and fits:
        sms = _sm_count(x.device)
        n0 = 0
        while n0 < n_all:   # chunks of up to 64 tokens (fewer where shared memory is short)
            n = warp_chunk(m, gk, min(spmm_warp.MAX_N, n_all - n0), vch, warps, stages, strips, sms)
            if n == 0 or not _launch_warp(x[n0:n0 + n], w, y[n0:n0 + n], bm, vals, goff, soff, vch, warps,
                                          stages, strips, regs, wflat):
                break
            n0 += n
        if n0 == n_all:
            return
        x, y, n_all = x[n0:], y[n0:], n_all - n0   # what spmm_warp could not take: spmm.py
    nsplit = splits if splits is not None else choose_splits(gm, gk)
    nsplit = min(max(nsplit, math.ceil(gk / spmm.KPER_MAX)), gk)
    kper = math.ceil(gk / nsplit)
    nsplit = math.ceil(gk / kper)
    if cuda_core_max_n is not None:
        ccmax = cuda_core_max_n
    else:
        ccmax = CUDA_CORE_MAX_N if m * gk * 64 <= CUDA_CORE_MAX_WEIGHTS else 0
    stream = None if SIM else _stream(x.device)
    for n0 in range(0, n_all, MAX_NT):
        n = min(MAX_NT, n_all - n0)
        nt, use_mma = (n, False) if n <= ccmax else variant(max(n, ccmax + 1))
        ws, cnt = _workspace(x.device, nsplit * nt * gm * 64, gm)
        slot = spmm.slot_words(vcap, nt)
        stages = max(s for s in (2, 3, 4) if s == 2 or s * slot * 8 <= DYN_SMEM_MAX)
        dyn = stages * slot * 8
        kern = spmm.get_kernel(nt, use_mma, stages)
        xv = _as_numba(x[n0:n0 + n].reshape(-1).view(torch.int64))
        yv = _as_numba(y[n0:n0 + n].reshape(-1).view(torch.int16))
        args = (bm, vals, goff, soff, xv, yv, _as_numba(ws), _as_numba(cnt), m, n, gk, kp // 4, kper, nsplit,
                vcap, slot)
        if SIM:  # CPU tensors: the numpy views share memory, so the kernel writes y in place
            kern[(gm, nsplit), spmm.THREADS, 0, dyn](*args)
        else:
            kern[(gm, nsplit), spmm.THREADS, stream, dyn](*args)
