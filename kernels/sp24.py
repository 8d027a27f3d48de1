"""Host side of the 2:4 tile-mosaic kernel: ``sp24_matmul(x, layout)`` on torch's current stream
(CUDA-graph capturable after one eager call per token bucket), or through the simulator on CPU
tensors under ``NUMBA_ENABLE_CUDASIM=1``. The layout is ``sparsekit.packed.sp24.Sp24Layout``."""
from __future__ import annotations

import torch

from . import sp24_plan
from .gpu_facts import fast_memory
from .io import output_for, padded


def sp24_matmul(x: torch.Tensor, layout, out: torch.Tensor | None = None, *, kernel: str = "auto",
                warps: int | None = None, strips: int | None = None, tokens: int | None = None,
                splits: int | None = None, stages: int | None = None, groups: int | None = None,
                kstep: int | None = None, cluster: int | None = None,
                slabs: torch.Tensor | None = None) -> torch.Tensor:
    """``y[N, M] = x[N, K] @ W^T`` (fp16 in and out, fp32 accumulate) for W in the 2:4 mosaic layout.

    ``kernel``:

    - ``"auto"`` (``sp24_plan.kernel_for``): the one that measured faster for this shape and token count;
      on a Hopper GPU "wg" and "ws" are among them for a weight whose tiles are all 2:4;
    - ``"rows"`` (``sp24_rows``: one or two tile rows per block, K split across blocks; ``tokens``,
      ``splits``, ``stages`` and ``strips`` (tile rows per block) force its plan);
    - ``"warps"`` (``sp24_kernel``: K split over a block's warps; ``warps``, ``strips`` force its plan);
    - ``"wg"`` (``sp24_wg``: Hopper's sparse warpgroup MMA, sm_90a, all-2:4 weights; ``tokens``,
      ``splits``, ``stages``, ``strips`` (tile rows per warpgroup), ``groups`` (warpgroups per block) and
      ``kstep`` (tile columns per step) force its plan);
    - ``"ws"`` (``sp24_ws``: the same products, warp-specialized, Hopper only; dense tiles too, one tile row
      per warpgroup; ``tokens``, ``splits``, ``stages``, ``strips``, ``groups`` force its plan; ``cluster`` (1, 2,
      4; more than 1 on a GPU only): thread-block clusters of neighbouring row blocks sharing each X slab by
      multicast, with no K split, docs/kernels-notes.md "v22"; by default ``sp24_plan.ws_cluster``'s choice on a
      GPU where no K split is forced, 1 elsewhere).

    ``slabs``: X already rewritten as sp24_ws reads it (``slab_tokens`` says for which tile width; the runtime
    makes them inside a compiled step); used where sp24_ws runs, ignored by the other kernels."""
    from . import launch
    from .common import SIM

    if x.dim() != 2 or x.dtype != torch.float16:
        raise ValueError(f"sp24_matmul expects fp16 x of shape [N, K], got {x.dtype} {tuple(x.shape)}")
    m, k = layout.shape
    n = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {k}")
    if not SIM and (not x.is_cuda or x.device != layout.device):
        raise ValueError(f"x ({x.device}) and the layout ({layout.device}) must share one CUDA device")
    forced = any(v is not None for v in (out, warps, strips, tokens, splits, stages, groups, kstep, cluster, slabs))
    out = output_for(x, m, out)
    if n == 0 or m == 0:
        return out
    gm, gk = layout.grid
    kp = gk * 64
    # an eager call at a shape, kernel choice and token count of its own: its launch kept for ``sp24_planned``
    record = None if forced or kernel != "auto" or kp != k or SIM else planned_key(layout.sp, layout.dense, n, k, m)
    x = padded(x, kp)
    if (cluster or 1) > 1 and kernel != "ws":
        raise ValueError(f"clusters take the warp-specialized kernel (kernel='ws'), not kernel={kernel!r}")
    if kernel == "auto":
        kernel = auto_kernel(x.device, m, k, n, layout.dense.numel() > 0)
    if kernel == "rows":
        _launch_rows(x, layout, out, m, n, gk, kp, launch, tokens, splits, stages, strips, record)
        return out
    if kernel in ("wg", "ws"):
        _launch_wg(x, layout, out, m, n, gk, kp, launch, tokens, splits, stages, strips, groups, kstep, kernel == "ws",
                   cluster, slabs=slabs, record=record)
        return out
    if kernel != "warps":
        raise ValueError(f"unknown 2:4 kernel {kernel!r}: 'rows', 'warps', 'wg' or 'ws'")
    from .sp24_kernel import get_kernel

    nt, r, nw, rb, chunks, dyn = sp24_plan.plan(m, gk, n, launch.sm_count(x.device), warps, strips)
    kern = get_kernel(nt, r)
    tensors = (*_buffers(layout), layout.tiles, x.reshape(-1).view(torch.int32),
               out.reshape(-1).view(torch.int16))
    launch.launch_tensors(kern, rb * chunks, 32 * nw, tensors, (m, n, gk, kp // 2, chunks), dyn=dyn,
                          record=record and (record, 3, 4, 0))
    return out


def planned_key(sp: torch.Tensor, dense: torch.Tensor, n: int, k: int, m: int) -> tuple:
    return ("sp24", sp.data_ptr(), dense.data_ptr(), n, k, m)


def sp24_planned(x: torch.Tensor, sp: torch.Tensor, dense: torch.Tensor, m: int) -> torch.Tensor | None:
    """``sp24_matmul(x, layout)`` (kernel "auto", nothing forced) for a call at a layout and token count that ran
    before through the driver's launch: its kept launch (``launch.replay``), a few us of the host's time; None where
    none is kept (then ``sp24_matmul``, which keeps one). ``x``: [N, K] fp16 on the layout's GPU; ``sp``, ``dense``:
    its tile buffers."""
    from . import launch

    return launch.replay(planned_key(sp, dense, x.shape[0], x.shape[1], m), x, m)


def _launch_rows(x, layout, out, m, n, gk, kp, launch, tokens, splits, stages, strips, record=None) -> None:
    from .sp24_rows import get_kernel

    aslot = sp24_plan.SLOTS[0] if layout.dense.numel() == 0 else sp24_plan.SLOTS[1]
    p = sp24_plan.rows_plan(m, gk, n, launch.sm_count(x.device), tokens, splits, stages, strips, aslot,
                            fast=_fast(x.device, m, gk * 64, n, aslot != sp24_plan.SLOTS[0]))
    # the fp32 workspace for the split-K partials (two tile slots per block), a counter per output tile
    ws, cnt = launch.workspace(x.device, p.workspace_floats(), p.tiles)
    tensors = (*_buffers(layout), layout.tiles, x.reshape(-1).view(torch.int32),
               out.reshape(-1).view(torch.int16), ws, cnt)
    maxreg = 128 if p.r * p.nt <= 64 else 168
    launch.launch_tensors(get_kernel(p.nt, p.stages, p.r, aslot, maxreg), p.blocks, 128, tensors,
                          (m, n, gk, kp // 2, p.chunks, p.per), dyn=p.dyn, record=record and (record, 3, 4, 0))


def _launch_wg(x, layout, out, m, n, gk, kp, launch, tokens, splits, stages, strips, groups, kstep,
               specialized: bool = False, cluster: int | None = 1, stamps: bool = False, slabs=None, record=None):
    """sp24_wg, or with ``specialized`` sp24_ws (its X as core-matrix slabs, one producer warp more; dense
    tiles too), whose blocks may form clusters sharing X (``cluster``). ``stamps`` (``sp24_ws_probe.ws_stamps``,
    inside its ``built_as``): the kernel writes into a zeroed float32 buffer instead of the K-split workspace.
    Returns ``(plan, tile rows, warpgroups, that buffer or None)``."""
    from .sp24_ws import probe_build, slabs_or_make

    hybrid = layout.dense.numel() > 0
    forced = stamps or any(v is not None for v in (tokens, splits, stages, strips, groups, kstep, cluster))
    key = (x.device, m, gk, n, hybrid, specialized, probe_build[0])   # (a probe build is a kernel of its own)
    got = None if forced else _WG.get(key)
    if got is None:
        got = _wg_launch(x.device, m, gk, n, kp, launch, tokens, splits, stages, strips, groups, kstep, specialized,
                         cluster, hybrid)
        if not forced:
            _WG[key] = got
    p, r, wg, kern, threads, scalars, cl = got
    if stamps:
        ws = torch.zeros(p.blocks * (p.per + 1) * 8, dtype=torch.float32, device=x.device)
        cnt = torch.zeros(max(p.tiles, 1), dtype=torch.int32, device=x.device)
    else:
        ws, cnt = launch.workspace(x.device, p.workspace_floats(), p.tiles)
    y = out.reshape(-1).view(torch.int16)
    if specialized:   # all 2:4: tile t is slot t of ``sp`` (the map is read only where tiles may be dense)
        dn, sp = _buffers(layout)
        tensors = (sp.view(torch.int64), dn.view(torch.int64), layout.tiles, slabs_or_make(x, p.nt, slabs),
                   y, ws, cnt)
        record = record and not stamps and (record, 3, 4, p.nt)
    else:             # every tile is 2:4: tile t is slot t of ``sp``, no map
        tensors = (layout.sp, x.reshape(-1).view(torch.int32), y, ws, cnt)
        record = record and not stamps and (record, 1, 2, 0)
    launch.launch_tensors(kern, p.blocks, threads, tensors, scalars, dyn=p.dyn, cluster=cl, record=record or None)
    return p, r, wg, ws if stamps else None


_WG: dict = {}       # the default plans' launches (``_wg_launch``) by device, shape, tokens, kind, kernel, build
_KERNEL: dict = {}   # ``auto_kernel``'s and ``slab_tokens``' answers by device, shape, tokens and kind


def _wg_launch(device, m, gk, n, kp, launch, tokens, splits, stages, strips, groups, kstep, specialized, cluster,
               hybrid):
    """``(plan, tile rows, warpgroups, kernel, threads, scalars, cluster)`` of a ``_launch_wg``: everything but
    the tensors, which an eager call at a token count planned before finds ready (~20 us of the host's time)."""
    from . import sp24_wg, sp24_ws
    from .common import SIM

    if cluster is None:   # the plan's choice, where clusters can run
        cluster = sp24_plan.ws_cluster(m, n, hybrid) if specialized and not SIM and (splits or 1) == 1 else 1
    if cluster > 1 and (not specialized or cluster not in (2, 4) or (splits or 1) > 1 or SIM):
        raise ValueError(f"clusters (got {cluster}) take 2 or 4 blocks of the warp-specialized kernel "
                         "(kernel='ws'), no K split, on a GPU (the simulator runs one block at a time)")
    if hybrid and not specialized:
        raise ValueError("the warpgroup 2:4 kernel (kernel='wg') takes weights whose tiles are all 2:4; this one "
                         "has dense tiles (kernel='ws' or 'rows' takes them)")
    p, r, wg, ks = sp24_plan.wg_plan(m, gk, n, launch.sm_count(device), tokens, 1 if cluster > 1 else splits,
                                     stages, strips, groups, kstep, specialized=specialized, hybrid=hybrid,
                                     fast=_fast(device, m, gk * 64, n, hybrid))
    if cluster > 1:   # whole clusters of row blocks (the padding blocks only receive X)
        p = p._replace(blocks=-(-p.rb // cluster) * cluster * p.chunks)
    if specialized:
        kern = sp24_ws.get_kernel(p.nt, p.stages, r, wg, hybrid, cluster)
        return p, r, wg, kern, sp24_ws.block_threads(wg, r, hybrid, cluster), (m, n, gk, p.chunks, p.per), cluster
    kern = sp24_wg.get_kernel(p.nt, p.stages, r, wg, ks)
    return p, r, wg, kern, 128 * wg, (m, n, gk, kp // 2, p.chunks, p.per), cluster


def auto_kernel(device: torch.device, m: int, k: int, n: int, hybrid: bool) -> str:
    """The kernel ``sp24_matmul(kernel="auto")`` runs for an ``m x k`` weight (with dense tiles: ``hybrid``) at
    ``n`` tokens on ``device`` (``sp24_plan.kernel_for``; the warpgroup kernels on a Hopper GPU only)."""
    key = (device, m, k, n, hybrid)
    got = _KERNEL.get(key)
    if got is None:
        from . import launch
        from .common import SIM

        got = _KERNEL[key] = sp24_plan.kernel_for(m, k, n, not SIM and launch.hopper(device), hybrid,
                                                  _fast(device, m, -(-k // 64) * 64, n, hybrid))
    return got


def slab_tokens(device: torch.device, m: int, k: int, n: int, hybrid: bool) -> int:
    """The tokens a tile of the X slabs that ``sp24_matmul(kernel="auto")`` reads for an ``m x k`` weight (with
    dense tiles: ``hybrid``) at ``n`` tokens, where its kernel is sp24_ws; 0 where the kernel reads X itself."""
    key = ("slabs", device, m, k, n, hybrid)
    got = _KERNEL.get(key)
    if got is None:
        from . import launch

        got = _KERNEL[key] = 0 if n < 1 or auto_kernel(device, m, k, n, hybrid) != "ws" else sp24_plan.wg_plan(
            m, -(-k // 64), n, launch.sm_count(device), specialized=True, hybrid=hybrid,
            fast=_fast(device, m, -(-k // 64) * 64, n, hybrid))[0].nt
    return got


def _fast(device, m: int, k: int, n: int, hybrid: bool) -> bool:
    """Whether this launch takes the fast-memory plans (``gpu_facts.fast_memory``, ``sp24_plan.fast_for``)."""
    return sp24_plan.fast_for(m, k, n, hybrid, fast_memory(device))


def _buffers(layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's (dense, 2:4) tile buffers; a kind with no tiles is never read, so the other kind's buffer
    stands in for it (no allocation per call)."""
    dense, sp = layout.dense, layout.sp
    return (dense if dense.numel() else sp), (sp if sp.numel() else dense)