"""ADMM weight update (Boža, "Fast and Effective Weight Update for Pruned Large Language Models", 2024).

The layer-wise problem SparseGPT solves in one OBS sweep, solved by the alternating direction method
of multipliers instead: for a keep-mask M, find the sparse W' closest to the dense W on the
calibration inputs X,

    min ||W X - W' X||^2   subject to   W' = 0 outside M.

Work happens in the normalized space of the paper: with d_j = sqrt(H_jj) (H = the input Hessian,
``stats.hessian``), ``Hn = D^-1 H D^-1`` has a unit diagonal and ``Wn = W D`` makes |Wn| the Wanda
score. With a damping ``damp`` added to Hn's diagonal (0.1, the paper's; the objective is then
``||(W'-W) X||^2 + damp * sum_j H_jj ||W'_:j - W_:j||^2``) and a penalty ``rho`` (1), each iteration is

    Z = (W + U) * M        (projection on the mask)
    U = U + W - Z          (scaled dual)
    W = (Wn Hd + rho (Z - U)) (Hd + rho I)^-1     (Hd = Hn + damp I; the inverse is computed once)

and the result is the last Z, scaled back. For a fixed mask the iteration converges to the problem's
optimum (it is convex). Without a mask (``--method admm``), the mask is chosen during the first
``gradual`` iterations (3/4 of them), as in the paper: the fraction of the final pruning done by
iteration t grows as ``1 - (1 - t/T)^3``, the weights pruned being those of lowest |W + U| (the
normalized, i.e. Wanda-like, score of the current iterate) among those the pattern's selection on
the same scores would prune (unstructured: over the whole matrix; N:M: per group; hybrid: the tiles
chosen from those scores, 2:4 inside).

With ``init`` (another method's weights on the same mask) the result is whichever of the two has the
lower error on the calibration inputs (undamped): the update never makes a method's layer worse.

Cost: one Cholesky of [in, in] and one [out, in] x [in, in] matmul per iteration, on the weight's
device, in fp32 (fp64 for fp64 weights).
"""
from __future__ import annotations

import torch

from sparsekit.errors import SparsekitError
from sparsekit.pruning.methods.base import Method, Observes, PruneResult
from sparsekit.pruning.patterns import Pattern, n_pruned, select_mask

DEFAULT_ITERS = 20
DAMP = 0.1  # the paper's dampening, in the normalized space
RHO = 1.0
GRADUAL = 0.75  # the share of the iterations that choose the mask (15 of 20 in the paper)


def reconstruction_error(dense: torch.Tensor, new: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr((W' - W) H (W' - W)^T): the layer's output error on the calibration inputs (up to H's scale)."""
    delta = (new.to(hessian.dtype) - dense.to(hessian.dtype))
    return float(((delta @ hessian) * delta).sum())


def _gradual_mask(scores: torch.Tensor, pattern: Pattern, sparsity: float, frac: float) -> torch.Tensor:
    """Keep-mask pruning the ``frac`` lowest-scoring of the weights the pattern would prune on ``scores``."""
    flat = scores.reshape(-1)
    if pattern.is_unstructured:  # the lowest of the lowest n are the lowest overall
        k = int(round(frac * n_pruned(flat.numel(), sparsity)))
        cand = None
    else:
        cand = (~select_mask(scores, pattern, sparsity, group="layer")).reshape(-1)
        k = int(round(frac * int(cand.sum())))
    keep = torch.ones(flat.shape, dtype=torch.bool, device=flat.device)
    if k > 0:
        s = flat if cand is None else flat.masked_fill(~cand, float("inf"))
        keep[torch.topk(s, k, largest=False, sorted=False).indices] = False
    return keep.reshape(scores.shape)


def admm_prune(weight: torch.Tensor, hessian: torch.Tensor, sparsity: float, pattern: "Pattern | str", *,
               keep: torch.Tensor | None = None, iters: int = DEFAULT_ITERS, damp: float = DAMP, rho: float = RHO,
               init: torch.Tensor | None = None, gradual: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Prune ``weight`` [out, in] given H [in, in] -> (new weight in the compute dtype, keep-mask, info).

    ``keep`` fixes the mask (any pattern's, a learned one); else the mask is chosen during the first
    ``gradual`` iterations (default 3/4 of ``iters``) at ``sparsity`` under ``pattern`` (module doc).
    Inputs whose H_jj is 0 (dead) are pruned. ``info``: ``admm_iters``, ``admm_error`` (the result's
    reconstruction error, relative to that of pruning without update) and, with ``init``, ``admm_kept``
    (False when ``init`` was better and is returned)."""
    pattern = Pattern.parse(pattern)
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    dev = weight.device
    rows, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise SparsekitError(f"admm: the Hessian is {tuple(hessian.shape)} but the weight is {tuple(weight.shape)}: "
                             "gather the statistics on this layer's inputs")
    if iters < 1:
        raise SparsekitError(f"admm needs at least one iteration, got {iters}")
    if keep is None and sparsity == 0 and not pattern.is_nm:  # nothing to prune
        return weight.detach().to(dtype, copy=True), torch.ones(rows, cols, dtype=torch.bool, device=dev), {"admm_iters": 0}
    W0 = weight.detach().to(dtype)
    H = hessian.detach().to(device=dev, dtype=dtype)
    diag = H.diagonal()
    dead = diag <= 0
    d = torch.where(dead, torch.ones_like(diag), diag).sqrt()
    Hn = H / d[:, None] / d[None, :]
    Hn.diagonal()[dead] = 1.0
    Wn = W0 * d
    Wn[:, dead] = 0
    Hd = Hn
    Hd.diagonal().add_(damp)
    target = Wn @ Hd  # the damped objective's linear term
    A = Hd.clone()
    A.diagonal().add_(rho)
    chol, err = torch.linalg.cholesky_ex(A)
    if int(err.item()):
        raise SparsekitError("admm: the normalized Hessian is not positive definite (NaN/inf activations?): "
                             "check the calibration data or skip this layer (--skip)")
    Ainv = torch.cholesky_inverse(chol)
    del A, chol
    fixed = keep is not None
    if fixed:
        mask = keep.to(device=dev, dtype=torch.bool) & ~dead[None, :]
    n_grad = 0 if fixed else max(1, min(iters, round(GRADUAL * iters) if gradual is None else int(gradual)))
    W, U = Wn.clone(), torch.zeros_like(Wn)
    for t in range(iters):
        if t < n_grad:
            frac = 1.0 - (1.0 - (t + 1) / n_grad) ** 3
            mask = _gradual_mask((W + U).abs(), pattern, sparsity, frac) & ~dead[None, :]
        Z = (W + U) * mask
        U += W - Z
        W = (target + rho * (Z - U)) @ Ainv
    Z = (W + U) * mask
    new_w = Z / d
    new_w[:, dead] = 0
    info = {"admm_iters": int(iters)}
    e_new = reconstruction_error(W0, new_w, H)
    e_zero = reconstruction_error(W0, W0 * mask, H)
    info["admm_error"] = e_new / e_zero if e_zero > 0 else 0.0
    if init is not None:
        e_init = reconstruction_error(W0, init.to(dtype) * mask, H)
        info["admm_kept"] = e_new <= e_init
        if e_new > e_init:
            new_w = init.to(dtype) * mask
    return new_w, mask, info


class Admm(Method):
    """``--method admm``: the mask chosen during the ADMM iterations (gradual, as in the paper)."""

    name = "admm"
    observes = Observes.HESSIAN

    def __init__(self, iters: int = DEFAULT_ITERS):
        self.iters = int(iters)

    def with_iters(self, iters: int) -> "Admm":
        return Admm(iters)

    def prune(self, weight, sparsity, pattern, stats, *, blocksize, percdamp, warn) -> PruneResult:
        if getattr(stats, "hessian", None) is None:
            raise SparsekitError("admm needs the input Hessian: gather stats with InputStats(..., hessian=True)")
        new_w, keep, info = admm_prune(weight, stats.hessian, sparsity, pattern, iters=self.iters)
        return PruneResult(new_w, keep, info)
