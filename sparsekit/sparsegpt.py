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

Works on the weight's device; computes in fp32 (fp64 for fp64 weights).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from sparsekit.errors import SparsekitError
from sparsekit.patterns import Pattern, expand_tiles, hybrid_sparse_tiles, n_pruned

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


def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float,
    pattern: Pattern,
    *,
    blocksize: int = 128,
    percdamp: float = 0.01,
    warn: Callable[[str], object] = print,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Prune ``weight`` [out, in] given H [in, in] -> (new weight, keep-mask, info).

    The new weight is in the compute dtype (fp32, or fp64 for fp64 input); the caller casts it.
    ``info``: ``damp`` (the percdamp used), ``dead`` (inputs with H_ii == 0, whose weights are
    zeroed), ``loss`` (sum of the OBS costs, 1/2 sum err^2), ``blocksize`` (as used: rounded up to a
    multiple of M for N:M and hybrid), and ``sparse_tiles`` for hybrid.
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
    m = pattern.m if structured else 1
    n_keep = pattern.n if structured else 0
    blocksize = max(1, int(blocksize))
    if structured:
        blocksize = -(-blocksize // m) * m
    info["blocksize"] = blocksize
    if sparsity == 0 and not pattern.is_nm:
        if pattern.is_hybrid:
            info["sparse_tiles"] = 0
        return weight.detach().to(dtype, copy=True), torch.ones(rows, cols, dtype=torch.bool, device=dev), info

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

    sparse_rows = None  # hybrid: [cols/T, rows] bool, rows that are 2:4 in each column tile
    if pattern.is_hybrid:
        tiles = hybrid_sparse_tiles((W * inv_d).square(), sparsity, pattern.tile)
        info["sparse_tiles"] = int(tiles.sum().item())
        sparse_rows = tiles.t().repeat_interleave(pattern.tile, dim=1).contiguous()
    budgets = _block_budgets(rows, cols, blocksize, sparsity) if pattern.is_unstructured else None

    Wt = W.t().contiguous()  # [cols, rows]: column c of W is the contiguous row Wt[c]
    del W
    prune_t = torch.zeros(cols, rows, dtype=torch.bool, device=dev)
    loss = torch.zeros((), dtype=dtype, device=dev)
    for b, i1 in enumerate(range(0, cols, blocksize)):
        i2 = min(i1 + blocksize, cols)
        count = i2 - i1
        W1 = Wt[i1:i2]  # view, updated in place
        U1 = U[i1:i2, i1:i2]
        P1 = prune_t[i1:i2]
        E1 = torch.empty(count, rows, dtype=dtype, device=dev)  # err of each column, w_pruned / U_cc
        # per-column views, made once per block (keeps the Python overhead of the sweep low)
        w_rows, e_rows, u_rows = W1.unbind(0), E1.unbind(0), U1.unbind(0)
        id1 = inv_d[i1:i2, None]
        if budgets is not None:
            k = budgets[b]
            if k == 0:  # nothing to prune in this block: no errors, no updates
                continue
            scores = (W1 * id1).square_().reshape(-1)
            P1.view(-1)[torch.topk(scores, k, largest=False, sorted=False).indices] = True
            f_rows = (P1 * id1).unbind(0)  # err = w * pruned / U_cc
        else:
            f_rows = [None] * count
        for j in range(count):
            if budgets is None and j % m == 0:
                scores = (W1[j : j + m] * id1[j : j + m]).square_()
                idx = torch.topk(scores, m - n_keep, dim=0, largest=False, sorted=False).indices
                Pg = P1[j : j + m]
                Pg.scatter_(0, idx, True)
                if sparse_rows is not None:
                    Pg &= sparse_rows[(i1 + j) // pattern.tile]
                f_rows[j : j + m] = (Pg * id1[j : j + m]).unbind(0)
            e = torch.mul(w_rows[j], f_rows[j], out=e_rows[j])
            if j + 1 < count:
                W1[j + 1 :].addr_(u_rows[j][j + 1 :], e, alpha=-1)
        W1.masked_fill_(P1, 0)
        loss += E1.square().sum()
        if i2 < cols:
            Wt[i2:].addmm_(U[i1:i2, i2:].t(), E1, alpha=-1)
    info["loss"] = float(loss.item()) / 2
    keep = ~prune_t.t()
    if n_dead:
        keep[:, dead] = False
    return Wt.t().contiguous(), keep.contiguous(), info
