"""DSnoT-style mask refinement (after Zhang et al., "Dynamic Sparse No Training", ICLR 2024).

Training-free: starting from a method's pruned layer W' (mask M), each row repeatedly revives one
pruned weight and prunes one kept weight in exchange, as long as the swap lowers the layer's
reconstruction error. DSnoT ranks and accepts swaps by a surrogate (the expected output error and
the input variance); here the criterion is the exact layer error

    E = tr((W - W') H (W - W')^T)        (H: the input Hessian, ``stats.hessian``)

which makes "never worse" a guarantee rather than a tendency. With ``G = (W - W') H`` kept up to date:

- reviving pruned weight j of row r at its error-optimal value ``v = G_rj / H_jj`` lowers E by
  ``G_rj^2 / H_jj`` (DSnoT revives the dense value; the optimal one is never worse);
- then pruning kept weight k (value w) raises E by ``2 w G'_rk + w^2 H_kk`` (G' after the revival).

A swap stays inside one comparison group, so the pattern holds: the whole row for unstructured masks
(each row keeps its count), one group of M for N:M, one group of 4 inside a 2:4 tile for hybrid
(dense tiles have nothing to swap). Each cycle picks, for every row at once, the group whose best
revival and best prune give the lowest change, applies it where it lowers E, and retires rows with
no improving swap; ``cycles`` bounds the swaps per row (DSnoT's maximum cycle count, 50).
"""
from __future__ import annotations

import torch

from sparsekit.pruning.patterns import Pattern

DEFAULT_CYCLES = 50
_REL_TOL = 1e-6  # a swap must lower the row's error by this fraction at least (floating-point noise)


def _group_size(pattern: Pattern, cols: int) -> int:
    if pattern.is_nm:
        return pattern.m
    if pattern.is_hybrid:
        return 4
    return cols


def dsnot_refine(dense: torch.Tensor, pruned: torch.Tensor, keep: torch.Tensor, hessian: torch.Tensor,
                 pattern: "Pattern | str", *, cycles: int = DEFAULT_CYCLES) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Refine ``pruned`` [out, in] (zero outside ``keep``) towards ``dense`` -> (weight, keep, info).

    ``info``: ``dsnot_swaps`` (swaps made over all rows) and ``dsnot_error`` (the error after,
    relative to before)."""
    pattern = Pattern.parse(pattern)
    dtype = torch.float64 if dense.dtype == torch.float64 else torch.float32
    dev = dense.device
    W = dense.detach().to(dtype)
    Wp = pruned.detach().to(device=dev, dtype=dtype).masked_fill(~keep.to(dev), 0)
    keep = keep.to(device=dev, dtype=torch.bool).clone()
    H = hessian.detach().to(device=dev, dtype=dtype)
    rows, cols = W.shape
    G = _group_size(pattern, cols)
    ng = cols // G
    hdiag = H.diagonal().clone()
    alive = hdiag > 0
    safe_diag = torch.where(alive, hdiag, torch.ones_like(hdiag))
    grad = (W - Wp) @ H  # G in the module doc
    err = ((W - Wp) * grad).sum(1)
    err0 = float(err.sum())
    active = torch.ones(rows, dtype=torch.bool, device=dev)
    swaps = 0
    ridx = torch.arange(rows, device=dev)
    for _ in range(max(0, int(cycles))):
        if not bool(active.any()):
            break
        r = ridx[active]
        g, kp, wp = grad[r], keep[r], Wp[r]
        # revival: gain g^2 / H_jj on pruned, live inputs
        gain = torch.where(~kp & alive[None, :], g.square() / safe_diag[None, :], torch.full_like(g, -1.0))
        gain_g = gain.reshape(len(r), ng, G)
        best_gain, jj = gain_g.max(dim=-1)  # per group
        j = jj + torch.arange(ng, device=dev)[None, :] * G  # column index [n, ng]
        v = g.gather(1, j) / safe_diag[j]  # the revived value
        # prune: cost 2 w g' + w^2 H_kk for kept k of the same group, g' = g - v H[j, k]
        kcols = torch.arange(cols, device=dev).reshape(ng, G)
        Hjk = H[j.unsqueeze(-1), kcols.unsqueeze(0)]  # [n, ng, G]
        gprime = g.reshape(len(r), ng, G) - v.unsqueeze(-1) * Hjk
        w = wp.reshape(len(r), ng, G)
        cost = 2 * w * gprime + w.square() * hdiag.reshape(ng, G)[None]
        cand = kp.reshape(len(r), ng, G) & (kcols[None] != j.unsqueeze(-1))
        cost = torch.where(cand, cost, torch.full_like(cost, float("inf")))
        best_cost, kk = cost.min(dim=-1)
        change = best_cost - best_gain
        change = torch.where(best_gain > 0, change, torch.full_like(change, float("inf")))
        dmin, grp = change.min(dim=1)
        ok = dmin < -_REL_TOL * err[r].abs()
        if not bool(ok.any()):
            break
        rr = r[ok]
        gsel = grp[ok]
        jsel = j[ok, gsel]
        ksel = kk[ok, gsel] + gsel * G
        vsel = v[ok, gsel]
        wk = Wp[rr, ksel]
        Wp[rr, jsel] = vsel
        Wp[rr, ksel] = 0
        keep[rr, jsel] = True
        keep[rr, ksel] = False
        grad[rr] += -vsel[:, None] * H[jsel] + wk[:, None] * H[ksel]
        err[rr] += dmin[ok]
        swaps += int(ok.sum())
        active[r[~ok]] = False
    err1 = float(((W - Wp) * ((W - Wp) @ H)).sum())
    info = {"dsnot_swaps": swaps, "dsnot_error": err1 / err0 if err0 > 0 else 0.0}
    return Wp, keep, info
