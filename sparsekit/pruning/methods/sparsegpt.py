"""SparseGPT (Frantar & Alistarh, 2023): one-shot pruning with OBS weight updates.

Columns (input features) are swept left to right. Pruning weight w_rc costs w_rc^2 / [H_F^-1]_cc
and is compensated by the OBS update of the not-yet-swept columns F of the same row,
``w_r,F -= w_rc / [H_F^-1]_cc * [H_F^-1]_c,F``. The rows of the upper Cholesky factor U of H^-1
(H^-1 = U^T U) give every [H_F^-1]_c,F at once (U_c,F = [H_F^-1]_c,F / sqrt([H_F^-1]_cc)), so one factorization
serves the whole sweep. Updates are applied lazily: inside a block of ``blocksize`` columns
column by column (vectorized over rows), to the columns right of the block with one matmul. The
lazy batching is exact, so the result does not depend on ``blocksize`` for a fixed mask.

Mask selection is adaptive: unstructured picks, at the start of each block, the lowest
w^2 / U_cc^2 scores of the block (the block's share of the layer's budget); N:M picks, at the
start of each group of M columns, the M-N lowest scores of every row from the current (already
updated) weights; hybrid chooses its 2:4 tiles up front from the initial scores, then does the
2:4 selection inside those tiles during the sweep.

Works on the weight's device; computes in fp32 (fp64 for fp64 weights). The in-block sweep is a
few hundred tiny kernels per block, the same sequence for every block of a given shape: on CUDA
each block is staged into static buffers and the sweep replayed from a CUDA graph captured once
per (rows, block columns, pattern, dtype, device) and cached for the process (``clear_graph_cache``).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable

import torch

from sparsekit.errors import SparsekitError
from sparsekit.pruning.methods.base import Method, Observes, PruneResult
from sparsekit.pruning.patterns import Pattern, expand_tiles, hybrid_sparse_tiles, n_pruned

MAX_DAMP_RETRIES = 7  # percdamp grows x10 per retry: 1% -> 1e5 % of the mean diagonal


def inverse_hessian_cholesky(
    hessian: torch.Tensor, percdamp: float = 0.01, warn: Callable[[str], object] = print
) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor U of (H + damp*I)^-1 (so that (H + damp*I)^-1 = U^T U), with
    damp = percdamp * mean(diag H); dead inputs (H_ii == 0) first get H_ii = 1.

    Computed without forming the inverse: with J the order-reversing permutation and
    J H J = L L^T, U = J L^-1 J (one Cholesky and one triangular solve). If the factorization
    fails (H numerically singular or indefinite), retries with 10x the dampening, says so through
    ``warn`` and returns the percdamp that worked. ``hessian`` is not modified.
    """
    rev = hessian.flip((0, 1))  # a copy: J H J (same diagonal, reversed)
    diag = rev.diagonal()
    diag[diag == 0] = 1
    mean_diag = diag.mean().item()
    if not math.isfinite(mean_diag) or mean_diag <= 0 or not bool(torch.isfinite(rev).all()):
        raise SparsekitError(
            "the input Hessian is not finite or has no positive diagonal: the calibration activations "
            "overflowed; calibrate in fp32/bf16 or with other data"
        )
    pd, added = float(percdamp), 0.0
    for attempt in range(MAX_DAMP_RETRIES + 1):
        diag.add_(pd * mean_diag - added)
        added = pd * mean_diag
        chol, err = torch.linalg.cholesky_ex(rev)
        if err.item() == 0:
            eye = torch.eye(chol.shape[0], dtype=chol.dtype, device=chol.device)
            inv = torch.linalg.solve_triangular(chol, eye, upper=False)  # L^-1
            del chol, eye
            if bool(torch.isfinite(inv.diagonal()).all()) and bool((inv.diagonal() > 0).all()):
                del rev
                upper = inv.flip((0, 1)).contiguous()
                if attempt:
                    warn(
                        f"sparsegpt: Cholesky failed with dampening {percdamp:g} of the mean Hessian "
                        f"diagonal (Hessian singular or indefinite); succeeded with {pd:g}"
                    )
                return upper, pd
            del inv
        pd = pd * 10 if pd > 0 else 0.01
    raise SparsekitError(
        f"the input Hessian is not positive definite even with dampening {pd / 10:g} of its mean "
        "diagonal: check the calibration data (NaN/inf activations?) or skip this layer (--skip)"
    )


def _block_budgets(rows: int, cols: int, blocksize: int, sparsity: float) -> list[int]:
    """Unstructured: how many weights each block prunes, so that the layer total is exactly
    floor(rows * cols * sparsity) (each block gets floor/ceil of its share)."""
    out, prev = [], 0
    for i2 in range(blocksize, cols + blocksize, blocksize):
        cum = n_pruned(rows * min(i2, cols), sparsity)
        out.append(cum - prev)
        prev = cum
    return out


def _sweep_block(
    W1: torch.Tensor,
    U1: torch.Tensor,
    id1: torch.Tensor,
    P1: torch.Tensor,
    E1: torch.Tensor,
    m: int = 0,
    n_keep: int = 0,
    sparse: "torch.Tensor | None" = None,
) -> None:
    """The OBS sweep of one block of columns, in place (the same kernel sequence for every block
    of a given shape, so it can be captured once in a CUDA graph and replayed).

    ``W1`` [count, rows] the block's columns (column c of W is row c), ``U1`` [count, count] the
    block's part of the Cholesky factor, ``id1`` [count, 1] = 1 / U_cc, ``E1`` [count, rows]
    receives the errors w_pruned / U_cc. ``m == 0`` (unstructured): ``P1`` already holds the block's
    prune mask. ``m > 0`` (N:M, hybrid): ``P1`` is all False on entry and every group of ``m``
    columns prunes its ``m - n_keep`` lowest scores per row, only in rows where ``sparse``
    [count, rows] is True (hybrid). The pruned weights end up zero.
    """
    count = W1.shape[0]
    # per-column views, made once per block (keeps the Python overhead of the sweep low)
    w_rows, e_rows, u_rows = W1.unbind(0), E1.unbind(0), U1.unbind(0)
    f_rows = list((P1 * id1).unbind(0)) if not m else [None] * count  # err = w * pruned / U_cc
    for j in range(count):
        if m and j % m == 0:
            scores = (W1[j : j + m] * id1[j : j + m]).square_()
            idx = torch.topk(scores, m - n_keep, dim=0, largest=False, sorted=False).indices
            Pg = P1[j : j + m]
            Pg.scatter_(0, idx, True)
            if sparse is not None:
                Pg &= sparse[j]
            f_rows[j : j + m] = (Pg * id1[j : j + m]).unbind(0)
        e = torch.mul(w_rows[j], f_rows[j], out=e_rows[j])
        if j + 1 < count:
            W1[j + 1 :].addr_(u_rows[j][j + 1 :], e, alpha=-1)
    W1.masked_fill_(P1, 0)


class _StagedSweep:
    """Static buffers for one block shape and, on CUDA, the captured graph of ``_sweep_block``.

    ``run()`` sweeps what was staged into ``W``, ``U``, ``id``, ``P`` (and ``sparse``): the first
    call runs the sweep eagerly on the capture stream (its result is kept, and it warms up the
    kernels), then captures it; later calls replay the graph (one launch instead of a few hundred).
    Without CUDA (or if the capture fails) every call runs eagerly on the same buffers.
    """

    def __init__(self, rows: int, count: int, m: int, n_keep: int, hybrid: bool, dtype, device):
        kw = dict(dtype=dtype, device=device)
        self.W = torch.zeros(count, rows, **kw)
        self.U = torch.zeros(count, count, **kw)
        self.id = torch.zeros(count, 1, **kw)
        self.E = torch.zeros(count, rows, **kw)
        self.P = torch.zeros(count, rows, dtype=torch.bool, device=device)
        self.sparse = torch.zeros(count, rows, dtype=torch.bool, device=device) if hybrid else None
        self.m, self.n_keep = m, n_keep
        self.graph = None
        self.capture = device.type == "cuda"
        self.failed: "str | None" = None  # why the capture failed, once

    def _eager(self) -> None:
        _sweep_block(self.W, self.U, self.id, self.P, self.E, self.m, self.n_keep, self.sparse)

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        if not self.capture:
            self._eager()
            return
        self.capture = False  # one try per shape
        dev = self.W.device
        main = torch.cuda.current_stream(dev)
        side = _capture_stream(dev)
        side.wait_stream(main)
        with torch.cuda.device(dev), torch.cuda.stream(side):
            self._eager()  # the real sweep of this block, and the warm-up before capturing
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: the engine's layer-mover thread may synchronize its own stream meanwhile
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._eager()  # recorded, not run: the buffers keep the result above
                finally:
                    graph.capture_end()
                self.graph = graph
            except RuntimeError as exc:  # pragma: no cover - depends on the CUDA/torch build
                self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
        main.wait_stream(side)


_STREAMS: dict = {}
GRAPH_CACHE: "OrderedDict[tuple, _StagedSweep]" = OrderedDict()  # (rows, count, m, n_keep, hybrid, dtype, device)
GRAPH_CACHE_SIZE = 16  # block shapes kept (a Llama-like model has 2-6); each holds ~5 blocks of buffers


def _capture_stream(device: torch.device):
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def _staged_sweep(rows: int, count: int, m: int, n_keep: int, hybrid: bool, dtype, device) -> _StagedSweep:
    """The cached ``_StagedSweep`` of this block shape (per process: one capture serves every block
    and layer of that shape)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (rows, count, m, n_keep, hybrid, dtype, device)
    st = GRAPH_CACHE.get(key)
    if st is None:
        st = GRAPH_CACHE[key] = _StagedSweep(rows, count, m, n_keep, hybrid, dtype, device)
        while len(GRAPH_CACHE) > GRAPH_CACHE_SIZE:
            GRAPH_CACHE.popitem(last=False)
    GRAPH_CACHE.move_to_end(key)
    return st


def clear_graph_cache() -> None:
    """Drop the cached CUDA graphs and their buffers (frees their GPU memory)."""
    GRAPH_CACHE.clear()
    _STREAMS.clear()


def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float,
    pattern: Pattern,
    *,
    blocksize: int = 128,
    percdamp: float = 0.01,
    warn: Callable[[str], object] = print,
    cuda_graph: "bool | None" = None,
    keep: "torch.Tensor | None" = None,
    sparse_tiles: "torch.Tensor | None" = None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Prune ``weight`` [out, in] given H [in, in] -> (new weight, keep-mask, info).

    The new weight is in the compute dtype (fp32, or fp64 for fp64 input); the caller casts it.
    ``info``: ``damp`` (the percdamp used), ``dead`` (inputs with H_ii == 0, whose weights are
    zeroed), ``loss`` (sum of the OBS costs, 1/2 sum err^2), ``blocksize`` (as used: rounded up to a
    multiple of M for N:M and hybrid), and ``sparse_tiles`` for hybrid.

    ``cuda_graph`` (default: on CUDA devices) sweeps each block in static buffers whose kernel
    sequence is captured once per block shape in a CUDA graph and replayed (the same kernels on the
    same numbers as the eager sweep; a capture failure falls back to it with a warning). On a CPU
    device ``True`` only stages the blocks through the same buffers (a testing aid).

    ``keep`` (bool [out, in], unstructured pattern only) fixes the mask instead of choosing it: the
    sweep prunes exactly the weights it marks False and updates the rest (a learned mask's update).
    ``sparse_tiles`` (bool [out/T, in/T], hybrid only) fixes which tiles are 2:4 (a global allocation)
    instead of choosing ``sparsity``'s share of them from the scores.
    """
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    dev = weight.device
    rows, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise SparsekitError(
            f"sparsegpt Hessian is {tuple(hessian.shape)} but the weight is {tuple(weight.shape)}: "
            "gather the statistics on this layer's inputs"
        )
    info: dict = {"damp": 0.0, "dead": 0, "loss": 0.0}
    structured = not pattern.is_unstructured  # N:M or hybrid: groups of M along the input dim
    m = pattern.m if structured else 0
    n_keep = pattern.n if structured else 0
    blocksize = max(1, int(blocksize))
    if structured:
        blocksize = -(-blocksize // m) * m
    info["blocksize"] = blocksize
    if keep is not None and not pattern.is_unstructured:
        raise SparsekitError("sparsegpt_prune: a fixed keep-mask goes with the unstructured pattern")
    if sparsity == 0 and not pattern.is_nm and keep is None and sparse_tiles is None:
        if pattern.is_hybrid:
            info["sparse_tiles"] = 0
        return weight.detach().to(dtype, copy=True), torch.ones(rows, cols, dtype=torch.bool, device=dev), info
    staged = dev.type == "cuda" if cuda_graph is None else bool(cuda_graph)

    W = weight.detach().to(dtype=dtype, copy=True)
    H = hessian.detach().to(device=dev, dtype=dtype)  # not modified: no copy needed
    dead = H.diagonal() == 0
    n_dead = int(dead.sum().item())
    info["dead"] = n_dead
    if n_dead:
        W[:, dead] = 0
    U, info["damp"] = inverse_hessian_cholesky(H, percdamp, warn)
    del H
    inv_d = U.diagonal().reciprocal()  # 1 / sqrt([H_F^-1]_cc)

    sparse_cols = None  # hybrid: [cols, rows] bool, whether row r is 2:4 in the tile of column c
    if pattern.is_hybrid:
        tiles = (hybrid_sparse_tiles((W * inv_d).square(), sparsity, pattern.tile) if sparse_tiles is None
                 else sparse_tiles.to(device=dev, dtype=torch.bool))
        info["sparse_tiles"] = int(tiles.sum().item())
        sparse_cols = expand_tiles(tiles.t(), pattern.tile)
    budgets = _block_budgets(rows, cols, blocksize, sparsity) if pattern.is_unstructured and keep is None else None
    fixed_t = None if keep is None else ~keep.to(dev).t()  # [cols, rows]: True = prune

    Wt = W.t().contiguous()  # [cols, rows]: column c of W is the contiguous row Wt[c]
    del W
    prune_t = torch.zeros(cols, rows, dtype=torch.bool, device=dev)
    loss = torch.zeros((), dtype=dtype, device=dev)
    for b, i1 in enumerate(range(0, cols, blocksize)):
        i2 = min(i1 + blocksize, cols)
        if budgets is not None and budgets[b] == 0:
            continue  # nothing to prune in this block: no errors, no updates
        sp = None if sparse_cols is None else sparse_cols[i1:i2]
        if staged:
            st = _staged_sweep(rows, i2 - i1, m, n_keep, sp is not None, dtype, dev)
            W1, U1, id1, P1, E1 = st.W, st.U, st.id, st.P, st.E
            W1.copy_(Wt[i1:i2])
            U1.copy_(U[i1:i2, i1:i2])
            id1.copy_(inv_d[i1:i2, None])
            P1.zero_()
            if sp is not None:
                st.sparse.copy_(sp)
        else:
            W1, U1, P1 = Wt[i1:i2], U[i1:i2, i1:i2], prune_t[i1:i2]  # views, updated in place
            id1 = inv_d[i1:i2, None]
            E1 = torch.empty(i2 - i1, rows, dtype=dtype, device=dev)
        if fixed_t is not None:
            P1.copy_(fixed_t[i1:i2])
        elif budgets is not None:  # unstructured: the block's share of the budget, chosen up front
            scores = (W1 * id1).square_().reshape(-1)
            P1.view(-1)[torch.topk(scores, budgets[b], largest=False, sorted=False).indices] = True
        if staged:
            st.run()
            if st.failed:
                warn(f"sparsegpt: CUDA graph capture failed ({st.failed}); sweeping without graphs")
                st.failed = None
            Wt[i1:i2].copy_(W1)
            prune_t[i1:i2].copy_(P1)
        else:
            _sweep_block(W1, U1, id1, P1, E1, m, n_keep, sp)
        loss += E1.square().sum()
        if i2 < cols:
            Wt[i2:].addmm_(U[i1:i2, i2:].t(), E1, alpha=-1)
    info["loss"] = float(loss.item()) / 2
    keep = ~prune_t.t()
    if n_dead:
        keep[:, dead] = False
    return Wt.t().contiguous(), keep.contiguous(), info


class SparseGPT(Method):
    name = "sparsegpt"
    observes = Observes.HESSIAN

    def prune(self, weight, sparsity, pattern, stats, *, blocksize, percdamp, warn) -> PruneResult:
        if getattr(stats, "hessian", None) is None:
            raise SparsekitError("sparsegpt needs the input Hessian: gather stats with InputStats(..., hessian=True)")
        new_w, keep, info = sparsegpt_prune(weight, stats.hessian, sparsity, pattern, blocksize=blocksize,
                                            percdamp=percdamp, warn=warn)
        return PruneResult(new_w, keep, info)
