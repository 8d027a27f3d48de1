"""``CatsMLP``: a gated MLP with a CATS threshold, run on the activation-sparse kernels at decode.

``enable_cats_kernels(model)`` swaps every gated MLP whose ``act_fn`` is a ``CatsActivation``
(installed from ``sparsekit.json`` by the loader) for a ``CatsMLP`` when the kernels can run it
(CUDA, fp16, SiLU, no biases, hidden size divisible by 8). For up to ``CatsMLP.max_tokens`` tokens a
forward is ``g = gate(x)`` (whatever gate is: ``nn.Linear`` or ``SparseLinear``), then
``sparsekit.kernels.cats.cats_up`` and ``cats_down``: up's rows and down's columns of inactive
neurons are never read. Their layouts are made here, once:

* dense up: its weight as it is (rows are contiguous); packed up: row-packed (``packed.rowpack``)
  from the decoded weight, beside the TCA-BME buffers;
* dense down: ``down^T`` tiled (``kernels.cats.tile_down``) beside the weight, which larger N
  still use: one extra copy of down; packed down: ``down^T`` row-packed.

Packed (weight-sparse) up/down take the kernels only with ``SPARSEKIT_CATS_ROWS=1``: on an H100
the row-packed kernels are slower than TCA-BME without CATS (docs/benchmarks.md), and a stacked
model must never be slower than its weight sparsity alone. Such MLPs keep the thresholded
activation on the TCA-BME path.

More tokens take the original module (thresholded activation, the MLP's own linears): at batch
> 1 the union of active neurons grows, and ``scripts/bench/cats.py`` measures where the kernels stop
paying (``DEFAULT_MAX_TOKENS``; env ``SPARSEKIT_CATS_MAX_TOKENS`` overrides).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from sparsekit.hf.compat import is_silu
from sparsekit.kernels.common import SIM
from sparsekit.hf.modules import find_gated_mlps, set_submodule
from sparsekit.packed.rowpack import rowpack
from sparsekit.runtime.cats import CatsActivation
from sparsekit.packed.tcabme import decode_dense
from sparsekit.runtime.sparse_linear import SparseLinear, kernel

DEFAULT_MAX_TOKENS = 1


def _env_max_tokens() -> int:
    raw = os.environ.get("SPARSEKIT_CATS_MAX_TOKENS")
    try:
        return max(0, min(8, int(raw))) if raw is not None else DEFAULT_MAX_TOKENS
    except ValueError:
        return DEFAULT_MAX_TOKENS


_EMPTY = {}


def _empty(device, dtype):
    key = (str(device), dtype)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return _EMPTY[key]


@torch.library.custom_op("sparsekit::cats_mlp", mutates_args=())
def cats_mlp_op(x: torch.Tensor, g: torch.Tensor, threshold: torch.Tensor, up_w: torch.Tensor,
                up_masks: torch.Tensor, up_values: torch.Tensor, up_goff: torch.Tensor, down_w: torch.Tensor,
                down_masks: torch.Tensor, down_values: torch.Tensor, down_goff: torch.Tensor,
                hidden: int) -> torch.Tensor:
    """``down(t(silu(g)) * up(x))`` on the CATS kernels (one torch op, so ``torch.compile`` keeps it
    whole). Row-packed up/down when their ``masks`` are non-empty, else dense ``up_w`` / tiled ``down_w``."""
    from sparsekit.kernels.cats import cats_down, cats_up
    from sparsekit.packed.rowpack import RowPacked

    n, inter = g.shape
    up = (RowPacked(up_masks, up_values, up_goff, (inter, hidden)) if up_masks.numel() else up_w)
    down = (RowPacked(down_masks, down_values, down_goff, (inter, hidden)) if down_masks.numel() else down_w)
    h = cats_up(g, x, up, threshold)
    return cats_down(h, down, torch.empty((n, hidden), dtype=x.dtype, device=x.device))


@cats_mlp_op.register_fake
def _cats_mlp_fake(x, g, threshold, up_w, up_masks, up_values, up_goff, down_w, down_masks, down_values,
                   down_goff, hidden):
    return x.new_empty((x.shape[0], hidden))


class CatsMLP(nn.Module):
    """A gated MLP with a CATS threshold; the activation-sparse kernels for up to ``max_tokens`` tokens."""

    max_tokens: int = _env_max_tokens()

    def __init__(self, mlp: nn.Module):
        from sparsekit.kernels.cats import tile_down

        super().__init__()
        self.mlp = mlp                                      # the larger-N path, left as it was
        up, down = mlp.up_proj, mlp.down_proj
        dev = up.values.device if isinstance(up, SparseLinear) else up.weight.device
        mlp.act_fn.to(dev)                                  # the threshold where the kernels read it
        e16, e8, e32 = _empty(dev, torch.float16), _empty(dev, torch.uint8), _empty(dev, torch.int32)
        if isinstance(up, SparseLinear):
            self.up_w, self.up_rows = e16, rowpack(decode_dense(up.packed).to(torch.float16))
        else:
            self.up_w, self.up_rows = up.weight, None       # rows are contiguous already: no copy
        if isinstance(down, SparseLinear):
            self.down_w, self.down_rows = e16, rowpack(decode_dense(down.packed).to(torch.float16).t().contiguous())
        else:
            self.down_w, self.down_rows = tile_down(down.weight.data.t().contiguous()), None
        self.hidden = down.out_features
        self.e8, self.e32, self.e16 = e8, e32, e16

    @property
    def threshold(self) -> torch.Tensor:
        return self.mlp.act_fn.threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] > self.max_tokens or not (x2.is_cuda or SIM) or x2.dtype != torch.float16:
            return self.mlp(x)
        x2 = x2.contiguous()
        g = self.mlp.gate_proj(x2).contiguous()
        u, d = self.up_rows, self.down_rows
        y = cats_mlp_op(x2, g, self.threshold,
                        self.up_w, u.masks if u else self.e8, u.values if u else self.e16, u.goff if u else self.e32,
                        self.down_w, d.masks if d else self.e8, d.values if d else self.e16,
                        d.goff if d else self.e32, self.hidden)
        return y.reshape(*lead, self.hidden)


def eligible(mlp: nn.Module) -> str | None:
    """Why ``mlp`` cannot run the CATS kernels, or None when it can."""
    if not isinstance(getattr(mlp, "act_fn", None), CatsActivation):
        return "no CATS threshold"
    if not is_silu(mlp.act_fn.act):
        return f"activation {type(mlp.act_fn.act).__name__} (the kernels compute SiLU)"
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(mlp, name)
        if not isinstance(lin, (nn.Linear, SparseLinear)):
            return f"{name} is a {type(lin).__name__}"
    for name in ("gate_proj", "up_proj", "down_proj"):
        if getattr(getattr(mlp, name), "bias", None) is not None:
            return f"{name} has a bias"
    packed = [n for n in ("up_proj", "down_proj") if isinstance(getattr(mlp, n), SparseLinear)]
    if packed and os.environ.get("SPARSEKIT_CATS_ROWS") != "1":   # the layers' kind, before where they are
        return (f"{' and '.join(packed)} packed: the row-packed CATS kernels are slower than TCA-BME alone "
                "(scripts/bench/cats.py); SPARSEKIT_CATS_ROWS=1 uses them anyway")
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(mlp, name)
        if isinstance(lin, nn.Linear) and (lin.weight.dtype != torch.float16 or not lin.weight.is_cuda):
            return "weights not fp16 on a GPU"
        if isinstance(lin, SparseLinear) and not lin.values.is_cuda:
            return "weights not on a GPU"
    if mlp.up_proj.in_features % 8:
        return "hidden size not divisible by 8"
    return None


MEASURE_SPARSITY = 0.5   # the activation sparsity a shape is timed at when the kernels are chosen
MIN_GAIN = 1.1           # the MLP alone must be this much faster on the kernels: in a compiled decode
                         # step the dense MLP fuses and the kernel path breaks the fusion
MIN_MLP_BYTES = 64 << 20  # smaller MLPs are launch-bound: on the demo model (5 MB MLPs) the kernels
                          # made decode 0.80x dense end to end (docs/benchmarks.md)


def kernel_gain(cats: CatsMLP, *, sparsity: float = MEASURE_SPARSITY, repeats: int = 20) -> float:
    """Dense MLP time over CATS-kernel time for one token (CUDA graphs, random unit-RMS input), with
    a threshold that zeroes ``sparsity`` of that input's activations: above 1 the kernels pay."""
    from sparsekit.runtime.timing import graph_ms

    mlp = cats.mlp
    hidden = mlp.up_proj.in_features
    dev = cats.up_w.device if cats.up_rows is None else cats.up_rows.values.device
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        xs = torch.randn((256, hidden), generator=gen, device=dev, dtype=torch.float16)
        a = mlp.act_fn.act(mlp.gate_proj(xs)).float().abs().flatten()
        t = torch.quantile(a[: 1 << 20], sparsity).reshape(())
        x = xs[:1].contiguous()
        saved = mlp.act_fn.threshold.clone()
        try:
            mlp.act_fn.threshold.copy_(t)
            dense = graph_ms(lambda: mlp(x), repeats=repeats)
            kern = graph_ms(lambda: cats(x), repeats=repeats)
        finally:
            mlp.act_fn.threshold.copy_(saved)
    return dense / kern if kern > 0 else 0.0


def enable_cats_kernels(model: nn.Module, *, measure: bool = True) -> int:
    """Swap, in place, each eligible CATS MLP of ``model`` for a ``CatsMLP``; returns how many run
    the kernels (already swapped ones included). 0 on the CPU or without the GPU kernels.

    With ``measure`` each MLP shape is timed once (``kernel_gain``: one token, activation sparsity
    ``MEASURE_SPARSITY``) and keeps its masked activation where the kernels do not beat dense (small
    MLPs, where a step is launch-bound). ``model.cats_kernel_report`` says what was chosen and why."""
    done = sum(isinstance(m, CatsMLP) for m in model.modules())
    if not any(isinstance(m, CatsActivation) for m in model.modules()):
        return done  # no thresholds: nothing to swap, and no reason to start the GPU kernels (seconds)
    if not torch.cuda.is_available() or kernel() is None:
        return done
    inner = {id(m.mlp) for m in model.modules() if isinstance(m, CatsMLP)}
    gains: dict[tuple, float] = {}
    report = {}
    for name, mlp in find_gated_mlps(model).items():
        if id(mlp) in inner:
            continue
        why = eligible(mlp)
        if why is not None:
            report[name] = why
            continue
        dense_bytes = 3 * 2 * mlp.up_proj.in_features * mlp.up_proj.out_features
        if measure and dense_bytes < MIN_MLP_BYTES:
            report[name] = (f"MLP of {dense_bytes / 2**20:.0f} MB: too small for the CATS kernels to pay "
                            f"(launch-bound below {MIN_MLP_BYTES >> 20} MB)")
            continue
        cats = CatsMLP(mlp)
        key = (type(mlp.gate_proj).__name__, mlp.up_proj.in_features, mlp.up_proj.out_features,
               cats.up_rows is None, cats.down_rows is None)
        if measure and key not in gains:
            gains[key] = kernel_gain(cats)
        if measure and gains[key] < MIN_GAIN:
            report[name] = (f"the CATS kernels gain too little for this shape ({gains[key]:.2f}x the dense MLP at "
                            f"{MEASURE_SPARSITY:.0%} activation sparsity, one token; {MIN_GAIN}x needed)")
            continue
        set_submodule(model, name, cats)
        report[name] = f"kernels ({gains[key]:.2f}x dense at {MEASURE_SPARSITY:.0%}, one token)" if measure else "kernels"
        done += 1
    try:
        model.cats_kernel_report = report
    except (AttributeError, TypeError):
        pass
    return done
