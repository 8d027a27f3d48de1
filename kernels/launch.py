"""Host side: torch tensors -> kernel launch on torch's current stream (CUDA-graph capturable).

Glue between the plan (plan.py: pure choices of kernel, grid, warps, stages, shared memory) and
numba (compat_numba.py: every reach into its internals). Everything here is cheap enough to run
inside ``torch.cuda.graph`` capture: no synchronization, no host<->device copies; workspaces are
cached per device and only grow. Numba compiles each kernel variant at its first launch, so warm
up (one eager call per token count) before capturing.
"""
from __future__ import annotations

import torch
from numba import cuda

from . import compat_numba, driver, kcache, plan, spmm, spmm_warp
from ._intrinsics import SIM
from sparsekit.torch_compat import raw_stream

compat_numba.silence_low_occupancy_warnings()

_SMEM_OPTIN_OK: bool | None = None
optin_done: set = set()      # numba dispatchers whose compiled function took the opt-in (numba's launch path)
optin_bytes: dict = {}       # (id(kern), device) -> the opt-in of the function launched directly for it

_streams: dict = {}
_work: dict = {}
_views: dict = {}
_sms: dict = {}
_fast: dict = {}      # (id(kernel), device index) -> cuda.core kernel, or None where the fast launch is off
_packs: dict = {}     # (fkey, blocks, threads, dyn, cluster, words) -> driver.Packed, shared by calls of that shape
planned: dict = {}    # an eager call's own launch, kept by its caller's key (``launch_tensors(record=)``):
#                       (driver.Packed, X's address word, the output's, X slab tokens or 0, the tensors it holds)
_PACKS_MAX = 4096
DRIVER_LAUNCH = "the driver's launch from kept argument words (cuda.core's launch costs ~20-40 us more a call)"
_VIEW_CACHE_MAX = 4096
_cc: dict = {}
_unusable: set = set()   # kernel cache files that could not be loaded (rewritten after numba compiles)

# dynamic shared memory from which a launch opts the kernel in first: 48 KB, less a margin for the
# kernel's static shared arrays (dynamic + static may not pass 48 KB without the opt-in; sp24_ws's hybrid
# ring of exactly 48 KB failed with CUDA_ERROR_INVALID_VALUE on an H100)
OPTIN_FROM = 48 * 1024 - 1024


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


def _capturing() -> bool:
    return not SIM and torch.cuda.is_current_stream_capturing()


def clear_caches() -> None:
    """Forget the cached device views of packed weights and the kept eager launches (they keep the weights' memory
    alive)."""
    _views.clear()
    planned.clear()


def _weight_views(w):
    """Numba views of the packed weight's tensors + its stage capacities, cached by address."""
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
        flat = [] if SIM else [f for a in arrays
                               for f in compat_numba.flat(a.device_ctypes_pointer.value or 0, a.size, a.dtype.itemsize)]
        cap = _capturing()
        chunks = (plan.strip_chunks(w, 1, cap), plan.strip_chunks(w, 2, cap), 0, plan.strip_chunks(w, 4, cap))
        v = arrays + (plan.vcap(w, cap), chunks, flat)
        if not SIM:
            if len(_views) >= _VIEW_CACHE_MAX:
                _views.clear()
            _views[key] = v
    return v


def workspace(device: torch.device, floats: int, rows: int):
    """fp32 split-K partials and the per-row arrival counters (zeroed once, reset by the kernel that
    used them; shared by every split kernel, which run one after another on torch's stream)."""
    key = str(device)
    ws, cnt = _work.get(key, (None, None))
    if ws is None or ws.numel() < floats:
        ws = torch.empty(max(floats, 1 << 16), dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < rows:
        cnt = torch.zeros(max(rows, 1024), dtype=torch.int32, device=device)
    _work[key] = (ws, cnt)
    return ws, cnt


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached; 132, an H100's, under the simulator)."""
    if SIM:
        return 132
    key = str(device)
    if key not in _sms:
        _sms[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sms[key]


def hopper(device: torch.device) -> bool:
    """Whether ``device`` is a Hopper GPU (compute capability 9.0: the sparse warpgroup MMA of sp24_wg)."""
    if device.index not in _cc:
        _cc[device.index] = torch.cuda.get_device_capability(device)
    return _cc[device.index] == (9, 0)


def smem_limit() -> int:
    """The dynamic shared memory an spmm_warp block may take here: WARP_SMEM_MAX unless this numba
    could not opt a kernel in past 48 KB (then DYN_SMEM_MAX)."""
    return plan.WARP_SMEM_MAX if _SMEM_OPTIN_OK is not False else plan.DYN_SMEM_MAX


def _allow_smem(kern, args, dyn: int) -> bool:
    """Let the kernel take up to WARP_SMEM_MAX (or ``dyn``, if more: a sp24_wg variant's fixed ring) of
    dynamic shared memory, past the default 48 KB."""
    global _SMEM_OPTIN_OK
    if dyn <= OPTIN_FROM or id(kern) in optin_done:
        return True
    if compat_numba.opt_in_smem(kern, args, max(plan.WARP_SMEM_MAX, dyn)):
        optin_done.add(id(kern))
        _SMEM_OPTIN_OK = True
        return True
    _SMEM_OPTIN_OK = False
    return False


def _stem(kern, args, device: torch.device) -> str | None:
    """``kern``'s kernel cache file stem for ``args`` on ``device`` (None: the cache is off or the kernel
    untagged)."""
    if SIM or not kcache.enabled():
        return None
    if device.index not in _cc:
        _cc[device.index] = torch.cuda.get_device_capability(device)
    return kcache.key_of(kern, args, _cc[device.index])


def _disk_kernel(kern, args, device: torch.device):
    """``kern`` compiled for ``args`` (arrays or tensors, then int scalars) and loaded from the kernel
    cache (``kcache``) without numba (its shared-memory opt-in: ``direct_ready``); None where it is not
    cached (or the cache is off): numba compiles it at its launch, and ``_keep`` stores it."""
    stem = _stem(kern, args, device)
    if stem is None or stem in _unusable:
        return None
    try:
        found = kcache.read(stem)
        if found is None:
            return None
        ck = compat_numba.load_cubin(*found)
    except Exception as e:  # noqa: BLE001 - said once; numba compiles it again and the file is rewritten
        _unusable.add(stem)
        kcache.note(f"kernel cache file {stem} could not be used ({type(e).__name__}: {e}); compiling it again")
        return None
    return ck


def direct_ready(fkey, ck, dyn: int, device: torch.device) -> bool:
    """Whether the directly launched function ``ck`` (``_fast[fkey]``) may take ``dyn`` bytes of dynamic shared
    memory: past 47 KB it is opted in (to WARP_SMEM_MAX, or ``dyn`` if more) the first time a launch needs it.
    The opt-in belongs to that function: one loaded from the kernel cache is not numba's compiled one, so a
    dispatcher opted in through numba's path says nothing about it (a second process with a warm cache failed
    with CUDA_ERROR_INVALID_VALUE when the first large launch of a kernel went through numba)."""
    global _SMEM_OPTIN_OK
    if dyn <= OPTIN_FROM or optin_bytes.get(fkey, 0) >= dyn:
        return True
    nbytes = max(plan.WARP_SMEM_MAX, dyn)
    if not compat_numba.set_max_dyn_smem(ck, nbytes, device.index):
        return False
    optin_bytes[fkey] = nbytes
    _SMEM_OPTIN_OK = True
    return True


def _keep(kern, args, device: torch.device) -> None:
    """Store ``kern`` as numba just compiled it for ``args`` in the kernel cache, for later processes."""
    stem = _stem(kern, args, device)
    if stem is None or (stem not in _unusable and (kcache.folder() / f"{stem}.json").exists()):
        return
    try:
        code = compat_numba.cubin_of(kern, args)
    except Exception as e:  # noqa: BLE001 - said once: this kernel compiles again in the next process
        kcache.note(f"kernel cache: cannot take the cubin of a compiled kernel ({type(e).__name__}: {e}); "
                    "each process compiles it again")
        return
    if code is not None:
        why = kcache.write(stem, *code)
        if why:
            kcache.note(f"kernel cache: cannot write under {kcache.folder()} ({why}); each process compiles "
                        "its kernels again")
        _unusable.discard(stem)


def _direct(ck, fkey, blocks: int, threads: int, dyn: int, device: torch.device, flat: list, scalars,
            cluster: int = 1):
    """Launch the checked kernel ``ck`` with its argument words ``flat`` + ``scalars`` on torch's current stream:
    through the driver from the words kept for this launch shape (``driver.Packed``, returned), or where the driver's
    launch cannot be loaded (said once) through cuda.core (None)."""
    why = driver.available()
    if why is None:
        words = flat + list(scalars)
        key = (fkey, blocks, threads, dyn, cluster, len(words))
        p = _packs.get(key)
        if p is None:
            if len(_packs) >= _PACKS_MAX:
                _packs.clear()
            p = _packs[key] = driver.Packed(compat_numba.handle_of(ck), blocks, threads, dyn, len(words), cluster)
        p.words[:] = words
        p.launch(raw_stream(device))
        return p
    compat_numba.lost(DRIVER_LAUNCH, why)
    compat_numba.launch_direct(ck, blocks, threads, dyn, _stream(device), flat, scalars, cluster)
    return None


def replay(key, x: torch.Tensor, m: int) -> torch.Tensor | None:
    """``x[N, K] @ W^T`` through the launch kept as ``planned[key]`` (a product of the same weight, kernel and token
    count that ran before through the driver): X, or its slabs where the kernel reads them, and a new ``[N, m]``
    output written into its words, one driver call (a few us of the host's time); None where none is kept or ``x``
    is not a contiguous, 16-byte aligned fp16 tensor (then the caller's full path, which keeps one)."""
    rec = planned.get(key)
    if rec is None or x.dtype != torch.float16 or not x.is_contiguous() or x.data_ptr() % 16:
        return None
    p, xw, yw, nt, _ = rec
    y = torch.empty((x.shape[0], m), dtype=torch.float16, device=x.device)
    if nt:
        from .sp24_ws import x_slabs

        x = x_slabs(x, nt)        # held until the launch below is queued
    p.words[xw] = x.data_ptr()
    p.words[yw] = y.data_ptr()
    p.launch(raw_stream(y.device))
    return y


def launch_tensors(kern, blocks: int, threads: int, tensors, scalars, dyn: int = 0, cluster: int = 1,
                   record=None) -> None:
    """Launch ``kern[blocks, threads]`` on torch's current stream with 1-D contiguous tensors (as
    numba arrays) then int64 scalars, directly once numba's packing of them is checked; ``dyn``
    bytes of dynamic shared memory (past 48 KB: opted in first). ``cluster`` > 1: thread-block clusters of
    that many blocks (``blocks`` a multiple of it), which numba's own launch cannot make: always direct.
    ``record``: ``(key, x index, output index, slab tokens)``: where the launch went through the driver, keep a copy
    of it as ``planned[key]`` (the tensors it names held), for a later eager call that writes X's (``tensors[x
    index]``) and the output's addresses into it and launches it (``replay``)."""
    device = tensors[0].device
    if SIM:
        if cluster > 1:
            raise RuntimeError("the simulator cannot launch thread-block clusters")
        kern[blocks, threads, 0, dyn](*[_as_numba(t) for t in tensors], *scalars)
        return
    fkey = (id(kern), device.index)
    if fkey not in _fast:
        ck = _disk_kernel(kern, (*tensors, *scalars), device)
        if ck is not None:
            _fast[fkey] = ck
    if cluster > 1 and _fast.get(fkey) is None:   # compiled and checked without a launch through numba
        if _numba_entry(kern, tuple(_as_numba(t) for t in tensors) + tuple(scalars), device, fkey) is None:
            raise RuntimeError("a thread-block cluster needs the direct launch, which is not available here")
    ck = _fast.get(fkey)
    if ck is not None and direct_ready(fkey, ck, dyn, device):
        flat = [f for t in tensors for f in compat_numba.flat(t.data_ptr(), t.numel(), t.element_size())]
        p = _direct(ck, fkey, blocks, threads, dyn, device, flat, scalars, cluster)
        if record is not None and p is not None and record[0] not in planned:   # (a direct caller's repeat)
            key, xi, yi, nt = record
            planned[key] = (p.copy(), 7 * xi + 4, 7 * yi + 4, nt, tuple(tensors))
        return
    if cluster > 1:
        raise RuntimeError(f"a thread-block cluster launch could not take {dyn} bytes of shared memory")
    args = tuple(_as_numba(t) for t in tensors) + tuple(scalars)
    if dyn > OPTIN_FROM and not _allow_smem(kern, args, dyn):
        raise RuntimeError(f"this numba cannot let a kernel take {dyn} bytes of shared memory (48 KB without opt-in)")
    kern[blocks, threads, _stream(device), dyn](*args)
    if fkey not in _fast:
        _numba_entry(kern, args, device, fkey)


def _numba_entry(kern, args, device: torch.device, fkey):
    """numba's compiled ``kern`` for ``args`` as the direct entry ``_fast[fkey]`` (its argument packing
    checked), stored in the kernel cache too; None where the direct launch is not available."""
    ck = _fast[fkey] = compat_numba.fast_entry(kern, args)
    if ck is not None:
        _keep(kern, args, device)
    return ck


def _launch_warp(x, w, y, bm, vals, goff, soff, vchs, warps, stages, strips, regs=None, wflat=None,
                 record=None) -> bool:
    """One spmm_warp launch for all of x's rows; False (nothing launched) if its plan cannot get
    the shared memory it needs."""
    n = x.shape[0]
    m, _ = w.shape
    gm, gk = w.grid
    sms = sm_count(x.device)
    r = strips or plan.warp_strips(m, gk, n, sms)
    vch = vchs[r - 1]
    nw, st, dyn = plan.warp_plan(m, gk, n, vch, warps, stages, r, sms, smem_limit())
    cmax = -(-vch // 32)
    kern = spmm_warp.get_kernel(n, st, cmax, r, regs)
    scalars = (m, gk, gk * 128, vch, spmm_warp.slot_words(vch, n, r))
    blocks = plan.warp_blocks(m, r)
    fkey = (id(kern), x.device.index)
    if not SIM and wflat and fkey not in _fast:
        ck = _disk_kernel(kern, (bm, vals, goff, soff, x.reshape(-1).view(torch.int64),
                                 y.reshape(-1).view(torch.int16)) + scalars, x.device)
        if ck is not None:
            _fast[fkey] = ck
    if not SIM and wflat and _fast.get(fkey) is not None and direct_ready(fkey, _fast[fkey], dyn, x.device):
        xs, ys = x.numel() // 4, y.numel()     # x as int64 words, y as int16
        p = _direct(_fast[fkey], fkey, blocks, 32 * nw, dyn, x.device,
                    [*wflat, *compat_numba.flat(x.data_ptr(), xs, 8), *compat_numba.flat(y.data_ptr(), ys, 2)], scalars)
        if record is not None and p is not None and record not in planned:   # X, y after the weight's 4 x 7 words
            planned[record] = (p.copy(), 7 * 4 + 4, 7 * 5 + 4, 0, (bm, vals, goff, soff))
        return True
    xv = _as_numba(x.reshape(-1).view(torch.int64))
    yv = _as_numba(y.reshape(-1).view(torch.int16))
    args = (bm, vals, goff, soff, xv, yv) + scalars
    if SIM:
        kern[blocks, 32 * nw, 0, dyn](*args)
        return True
    if not _allow_smem(kern, args, dyn):
        nw, st, dyn = plan.warp_plan(m, gk, n, vch, warps, stages, r, sms, smem_limit())   # now under 48 KB
        if dyn > smem_limit():
            return False
        kern = spmm_warp.get_kernel(n, st, cmax, r, regs)
    kern[blocks, 32 * nw, _stream(x.device), dyn](*args)
    fkey = (id(kern), x.device.index)
    if fkey not in _fast:
        _fast[fkey] = compat_numba.fast_entry(kern, args)
        if _fast[fkey] is not None:
            _keep(kern, args, x.device)
    return True


def launch(x: torch.Tensor, w, y: torch.Tensor, *, splits: int | None = None,
           cuda_core_max_n: int | None = None, warp_kernel: bool | None = None,
           warps: int | None = None, stages: int | None = None, strips: int | None = None,
           regs: int | None = None, record=None) -> None:
    """y[N, M] = x[N, Kp] @ W^T; x already padded to Kp columns, contiguous, 16-byte aligned. ``record``: a key under
    which a product that takes one spmm_warp launch keeps it (``replay``)."""
    n_all = x.shape[0]
    m, _ = w.shape
    gm, gk = w.grid
    kp = gk * 64
    bm, vals, goff, soff, vcap, vch, wflat = _weight_views(w)
    # spmm_warp unless K needs more warps than a block's register file holds (K > 32768 columns)
    fits = gk <= plan.MAX_STEPS * 16
    if warp_kernel is not False and fits:
        sms = sm_count(x.device)
        n0 = 0
        while n0 < n_all:   # chunks of up to 64 tokens (fewer where shared memory is short)
            n = plan.warp_chunk(m, gk, min(plan.MAX_N, n_all - n0), vch, warps, stages, strips, sms, smem_limit())
            if n == 0 or not _launch_warp(x[n0:n0 + n], w, y[n0:n0 + n], bm, vals, goff, soff, vch, warps,
                                          stages, strips, regs, wflat, record if n == n_all else None):
                break
            n0 += n
        if n0 == n_all:
            return
        x, y, n_all = x[n0:], y[n0:], n_all - n0   # what spmm_warp could not take: spmm.py
    nsplit, kper = plan.split_plan(gm, gk, splits)
    ccmax = plan.cuda_core_max(m, gk, cuda_core_max_n)
    stream = None if SIM else _stream(x.device)
    for n0 in range(0, n_all, plan.MAX_NT):
        n = min(plan.MAX_NT, n_all - n0)
        nt, use_mma = (n, False) if n <= ccmax else plan.variant(max(n, ccmax + 1))
        ws, cnt = workspace(x.device, nsplit * nt * gm * 64, gm)
        slot = spmm.slot_words(vcap, nt)
        st = plan.spmm_stages(slot)
        dyn = st * slot * 8
        kern = spmm.get_kernel(nt, use_mma, st)
        xv = _as_numba(x[n0:n0 + n].reshape(-1).view(torch.int64))
        yv = _as_numba(y[n0:n0 + n].reshape(-1).view(torch.int16))
        args = (bm, vals, goff, soff, xv, yv, _as_numba(ws), _as_numba(cnt), m, n, gk, kp // 4, kper, nsplit,
                vcap, slot)
        if SIM:  # CPU tensors: the numpy views share memory, so the kernel writes y in place
            kern[(gm, nsplit), spmm.THREADS, 0, dyn](*args)
        else:
            kern[(gm, nsplit), spmm.THREADS, stream, dyn](*args)
