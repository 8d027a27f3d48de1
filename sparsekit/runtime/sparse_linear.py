"""``SparseLinear``: a linear layer whose weight lives in TCA-BME form (docs/format.md).

Which path runs ``y = x @ W^T + b`` (``N`` = number of tokens, all leading dims flattened):

* CUDA, fp16, ``N <= SparseLinear.dense_above`` -> the bundled kernel
  ``sparsekit.kernels.tcabme_matmul`` (decode steps; launched on torch's current stream, so a
  CUDA graph can capture it); or, for a layer given its 2:4 layout (``runtime.sp24.enable_sp24``; the
  dispatch plan gives it where it measures faster, under ``SPARSEKIT_SP24=1``) and ``N <= sp24_max_n`` or
  ``sp24_from_n <= N`` (when nonzero), the 2:4 tile-mosaic kernel ``sparsekit.kernels.sp24.sp24_matmul``.
* CUDA, ``N > dense_above`` with a kept dense copy (``runtime.dispatch``, ``prefer="speed"``) ->
  ``F.linear`` on that copy.
* CUDA, ``N > dense_above`` (prefill) -> decode the tiles to a dense weight on the GPU (``sparsekit.kernels.decode``;
  inside a compiled or captured step too, through the op ``tcabme_mm``: no host sync), then ``F.linear``. The
  threshold: ``SPARSEKIT_DENSE_ABOVE`` or per module (``layer.dense_above = n``). A layer that keeps only its 2:4
  layout (``runtime.sp24.keep_only_sp24``, ``prefer="memory"``) decodes that (``sp24_dense_linear``) instead.
* Anything else (CPU, bf16/fp32 activations, kernels missing) -> the reference path (decode + matmul in the
  activation dtype), announced once per process on the CPU. The packed tensors are module buffers, so
  ``model.to(device)`` moves them with the rest.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.hf.modules import weight_out_in
from sparsekit.errors import SparsekitError, SparsekitWarning
from sparsekit.packed.tcabme import TcaBme, decode, decode_dense, encode
from sparsekit.runtime.slabs import sp24_slabs, tcabme_slabs
from sparsekit.runtime.sp24 import sp24_dense_linear, sp24_mm, sp24_mm_eager, sp24_weight

# Kernel up to and including this many tokens, decode + cuBLAS above: measured on an H100 with
# scripts/checks/gpu_runtime.py (7B shapes, 50%, eager calls; see docs/benchmarks.md, "End to end").
# With the decode kernel (0.11-0.19 ms per 7B weight) decode + cuBLAS wins from 96 tokens on.
DEFAULT_DENSE_ABOVE = 64

NO_GPU_NOTICE = "no CUDA GPU: sparse layers run the reference path (decode + matmul), which is slow"
CPU_NOTICE = "sparse layers on the CPU run the reference path (decode + matmul), which is slow"

notices_shown: set[str] = set()   # the notices this process has shown (``notice_once``)


# Frames of these packages are not where a notice "comes from": it points at the caller's own line
# (``model(x)`` or ``model.generate(...)``), never into torch's module.py.
_INTERNAL = ("torch", "transformers", "accelerate", "sparsekit")


def _caller_frame():
    frame = sys._getframe(1)
    outermost = frame
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not any(module == p or module.startswith(p + ".") for p in _INTERNAL):
            return frame
        outermost, frame = frame, frame.f_back
    return outermost


def notice_once(message: str) -> None:
    """Warn once per process with a ``SparsekitWarning`` (a UserWarning) attributed to the first
    caller outside torch / transformers / sparsekit; the CLI shows just the message on stderr."""
    if message in notices_shown:
        return
    notices_shown.add(message)
    frame = _caller_frame()
    module = frame.f_globals.get("__name__", "sparsekit")
    where = dict(filename=frame.f_code.co_filename, lineno=frame.f_lineno, module=module,
                 registry=frame.f_globals.setdefault("__warningregistry__", {}))
    try:
        warnings.warn_explicit(message, SparsekitWarning, module_globals=frame.f_globals, **where)
    except ImportError:  # a caller run as `python -m pkg.mod`: its loader will not read "__main__"'s source
        warnings.warn_explicit(message, SparsekitWarning, **where)


_KERNEL: Callable | None | bool = None  # None: not looked up yet; False: unavailable


def kernel() -> Callable | None:
    """``sparsekit.kernels.tcabme_matmul`` if the kernels pass their load-time check
    (``sparsekit.kernels.health.kernel_status``: a GPU, numba-cuda, one small product compiled, run and
    checked; the pass remembered on disk by ``runtime.selftest_cache``), else None, with one notice saying
    why and what to install. The loader calls this when it puts sparse layers on a GPU, so a kernel that
    cannot compile is found then, never mid-forward."""
    global _KERNEL
    if _KERNEL is None:
        try:
            from sparsekit.runtime.selftest_cache import kernel_status

            status = kernel_status()
            if status.ok:
                from sparsekit.kernels import tcabme_matmul

                _KERNEL = tcabme_matmul
            else:
                _KERNEL = False
                notice_once(f"sparse GPU kernels unavailable ({status.line}): sparse layers run the reference path")
        except SparsekitError:  # a damaged self-test cache under SPARSEKIT_STRICT=1
            raise
        except Exception as e:  # kernels not importable: keep running, say so once
            notice_once(f"sparse GPU kernels unavailable ({type(e).__name__}: {e}): sparse layers run the reference path")
            _KERNEL = False
    return _KERNEL or None


@torch.compiler.assume_constant_result
def kernels_ready() -> bool:
    """Whether the bundled GPU kernel can run (a constant to ``torch.compile``)."""
    return kernel() is not None


def tcabme_mm_eager(x: torch.Tensor, bitmaps: torch.Tensor, values: torch.Tensor, gtile_offsets: torch.Tensor,
              strip_offsets: torch.Tensor, out_features: int, use_kernel: bool,
              slabs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x[N, K] @ W^T`` for W given by its TCA-BME tensors: the bundled kernel when ``use_kernel`` (``slabs``: X
    as spmm_ws reads it), else decode (on a GPU the decode kernel, 10-25x faster than ``decode_dense``, session
    23) + matmul in x's dtype. A compiled step takes it as the op ``tcabme_mm``, eager calls this function
    itself (``op_or_eager``)."""
    w = TcaBme(bitmaps=bitmaps, values=values, gtile_offsets=gtile_offsets, strip_offsets=strip_offsets,
               shape=(out_features, x.shape[1]))
    if use_kernel:  # the kernel reads values through the offsets: a padded tail is harmless
        return kernel()(x, w) if slabs is None else kernel()(x, w, slabs=slabs)
    if values.is_cuda and kernels_ready():   # so does the decode kernel (no host sync: capturable)
        from sparsekit.kernels.decode import tcabme_decode

        return F.linear(x, tcabme_decode(w).to(x.dtype))
    w.values = values[: int(gtile_offsets[-1])]  # drop padding added by fusion.equalize_packed_sizes
    return F.linear(x, decode(w).to(x.dtype))


tcabme_mm = torch.library.custom_op("sparsekit::tcabme_mm", mutates_args=())(tcabme_mm_eager)


def op_or_eager(op: Callable, fn: Callable) -> Callable:
    """``op`` (a custom op: kept whole by ``torch.compile``) inside a compiled step, else ``fn`` (~20-60 us less)."""
    return op if torch.compiler.is_compiling() else fn


@tcabme_mm.register_fake
def _tcabme_mm_fake(x, bitmaps, values, gtile_offsets, strip_offsets, out_features, use_kernel, slabs=None):
    return x.new_empty((x.shape[0], out_features))


def _env_dense_above() -> int:
    raw = os.environ.get("SPARSEKIT_DENSE_ABOVE")
    if raw is None:
        return DEFAULT_DENSE_ABOVE
    try:
        return int(raw)
    except ValueError:
        raise SparsekitError(f"SPARSEKIT_DENSE_ABOVE={raw!r} is not an integer: set it to a token count such as 64")


class SparseLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` ([out_features, in_features]) stored as TCA-BME buffers."""

    dense_above: int = _env_dense_above()
    # the 2:4 kernel (when enabled) up to this many tokens, the TCA-BME kernel above: its first design
    # re-reads X per 16-64 rows, which the prediction (docs/kernels-notes.md "v13-sp") says loses from 32 on
    sp24_max_n: int = 16
    sp24_from_n: int = 0          # nonzero: the 2:4 kernel also from this many tokens up to dense_above
    sp24_only: bool = False       # the 2:4 layout is the weight's only copy (``runtime.sp24.keep_only_sp24``)

    def __init__(self, packed: TcaBme, bias: torch.Tensor | None = None, *, transposed: bool = False):
        super().__init__()
        m, k = (int(s) for s in packed.shape)
        self.out_features, self.in_features = m, k
        self.transposed = transposed  # informational: the source was a GPT-2 Conv1D ([in, out])
        self.register_buffer("bitmaps", packed.bitmaps)
        self.register_buffer("values", packed.values)
        self.register_buffer("gtile_offsets", packed.gtile_offsets)
        self.register_buffer("strip_offsets", packed.strip_offsets)
        if bias is not None:
            if bias.shape != (m,):
                raise SparsekitError(f"bias of shape {tuple(bias.shape)} does not fit a [{m}, {k}] weight: the checkpoint is inconsistent")
            self.register_buffer("bias", bias)
        else:
            self.bias = None
        self._nnz: int | None = None   # counted on first use (a popcount and a device sync per layer at load)
        self.n_values = int(packed.values.numel())  # the buffer may be padded past this later
        # a dense copy of the weight for token counts above dense_above (runtime.dispatch, prefer="speed"), and
        # the 2:4 tile-mosaic layout (runtime.sp24); never saved
        for name in ("dense_copy", "sp24_dense", "sp24_sp", "sp24_tiles"):
            self.register_buffer(name, None, persistent=False)
        self._packed, self._packed_src = None, None   # the TcaBme over these buffers, and its values (``packed``)
        # what encode recorded (the loader sets them): the weight's 64x64 tiles that are 2:4 / dense / neither
        # (``packed.sp24.tile_census``), and the pruning pattern
        self.tile_census: dict | None = None
        self.pattern: str | None = None

    # construction ---------------------------------------------------------------------------
    @classmethod
    def from_packed(cls, packed: TcaBme, bias: torch.Tensor | None = None, *, device=None,
                    dtype: torch.dtype | None = None, transposed: bool = False) -> "SparseLinear":
        """Wrap a TcaBme (moved to ``device``); ``dtype`` casts the bias (values stay as stored)."""
        if device is not None:
            packed = packed.to(device)
        if bias is not None:
            bias = bias.to(device=packed.device, dtype=dtype or bias.dtype)
        return cls(packed, bias, transposed=transposed)

    @classmethod
    def from_linear(cls, module: nn.Module, *, dtype: torch.dtype | None = None) -> "SparseLinear":
        """Encode an ``nn.Linear`` / ``Conv1D`` (its zeros are the pruned weights) on its device.

        TCA-BME stores fp16/bf16: an fp32 weight is cast to ``dtype`` (default fp16) first.
        """
        w = weight_out_in(module).detach()
        if w.dtype not in (torch.float16, torch.bfloat16):
            w = w.to(dtype or torch.float16)
        elif dtype is not None:
            w = w.to(dtype)
        w = w + 0.0  # -0.0 -> +0.0: the format keeps -0.0 as a stored value, which costs space for nothing
        bias = getattr(module, "bias", None)
        bias = None if bias is None else bias.detach().clone()
        transposed = not isinstance(module, nn.Linear)
        sl = cls(encode(w.contiguous()), bias, transposed=transposed)
        from sparsekit.packed.sp24 import tile_census

        sl.tile_census = tile_census(w)    # as encode records it: the dispatch plan's 2:4 choice reads it
        return sl

    # the packed weight ----------------------------------------------------------------------
    @property
    def packed(self) -> TcaBme:
        """The weight as a TcaBme over this module's buffers (cached; rebuilt after ``.to()``)."""
        if self.sp24_only:
            raise SparsekitError("this layer keeps only its 2:4 layout (prefer='memory'): it has no TCA-BME form")
        p = self._packed
        if p is None or self._packed_src is not self.values or p.bitmaps is not self.bitmaps:
            values = self.values if self.values.numel() == self.n_values else self.values[: self.n_values]
            p = self._packed = TcaBme(
                bitmaps=self.bitmaps, values=values, gtile_offsets=self.gtile_offsets,
                strip_offsets=self.strip_offsets, shape=(self.out_features, self.in_features),
            )
            self._packed_src = self.values
        return p

    @property
    def nnz(self) -> int:
        """Stored nonzeros (the bitmaps' popcount), counted once, on first use."""
        self._nnz = self.packed.nnz if self._nnz is None else self._nnz
        return self._nnz

    def _apply(self, fn, *args, **kwargs):
        self._packed = self._packed_src = None
        return super()._apply(fn, *args, **kwargs)

    def dense_weight(self, dtype: torch.dtype | None = None, *, use_kernels: bool = True) -> torch.Tensor:
        """The decoded ``[out, in]`` weight (bit-exact), optionally cast. On a GPU with the bundled
        kernels, one decode kernel (``sparsekit.kernels.decode``); otherwise ``tcabme.decode``.
        ``use_kernels=False`` never touches the kernels (no self-test, no compile): on a GPU the sync-free
        torch decode (:func:`decode_dense`). ``sp24_only``: the 2:4 layout, decoded (``runtime.sp24``)."""
        if self.sp24_only:
            return sp24_weight(self, dtype)
        p = self.packed
        if not use_kernels:
            w = decode_dense(p) if p.values.is_cuda else decode(p)
        elif p.values.is_cuda and kernels_ready():
            from sparsekit.kernels.decode import tcabme_decode

            w = tcabme_decode(p)
        else:
            w = decode(p)
        return w if dtype is None else w.to(dtype)

    def to_linear(self, dtype: torch.dtype | None = None, *, use_kernels: bool = True) -> nn.Linear:
        """A plain ``nn.Linear`` with the decoded weight (in ``dtype``, default the stored one);
        ``use_kernels`` as for :meth:`dense_weight`."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device="meta")
        lin.weight = nn.Parameter(self.dense_weight(dtype, use_kernels=use_kernels), requires_grad=False)
        if self.bias is not None:
            b = self.bias.detach().clone()
            lin.bias = nn.Parameter(b if dtype is None else b.to(dtype), requires_grad=False)
        return lin

    def keep_dense_copy(self) -> None:
        """Keep the decoded fp16 weight beside the packed one: above ``dense_above`` tokens cuBLAS runs on it."""
        if self.dense_copy is None:
            self.dense_copy = self.dense_weight(torch.float16).contiguous()

    def use_sp24(self, layout) -> None:
        """Run the 2:4 tile-mosaic kernel where the TCA-BME kernel would run (``layout``: this weight's
        ``sparsekit.packed.sp24.Sp24Layout``); ``None`` turns it off."""
        if layout is not None and tuple(layout.shape) != (self.out_features, self.in_features):
            raise SparsekitError(f"a 2:4 layout of shape {tuple(layout.shape)} does not fit this "
                                 f"[{self.out_features}, {self.in_features}] layer")
        dev = self.values.device
        self.sp24_dense = None if layout is None else layout.dense.to(dev)
        self.sp24_sp = None if layout is None else layout.sp.to(dev)
        self.sp24_tiles = None if layout is None else layout.tiles.to(dev)

    @property
    def form(self) -> str:
        """The kernel this layer runs at decode sizes on a GPU: ``"sp24"`` or ``"tcabme"``."""
        return "sp24" if self.sp24_tiles is not None else "tcabme"

    def dense_copy_bytes(self) -> int:
        return 0 if self.dense_copy is None else self.dense_copy.numel() * self.dense_copy.element_size()

    def sp24_bytes(self) -> int:
        """Bytes of the 2:4 layout (0 without one)."""
        ts = (self.sp24_dense, self.sp24_sp, self.sp24_tiles)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def sp24_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[N, K] @ W^T + b`` through the 2:4 tile-mosaic kernel whatever N is (CUDA, fp16; ``forward`` at its token
        counts, measurements); X's slabs made outside the op in a compiled step (``runtime.slabs``), else in it."""
        xc, cc = x.contiguous(), torch.compiler.is_compiling()
        y = op_or_eager(sp24_mm, sp24_mm_eager)(xc, self.sp24_dense, self.sp24_sp, self.sp24_tiles, self.out_features,
                                                sp24_slabs(self, xc) if cc else None)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[N, K] @ W^T + b`` through the sparse kernel whatever N is (CUDA, fp16; ``forward`` at its token
        counts, and measurements), with the slabs as ``sp24_forward``."""
        xc, cc = x.contiguous(), torch.compiler.is_compiling()
        y = op_or_eager(tcabme_mm, tcabme_mm_eager)(xc, self.bitmaps, self.values, self.gtile_offsets,
                                                    self.strip_offsets, self.out_features, True,
                                                    tcabme_slabs(self, xc) if cc else None)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @property
    def sparsity(self) -> float:
        return 1.0 - self.nnz / max(1, self.out_features * self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sparsity={self.sparsity:.3f}, dtype={self.values.dtype}" + (", form=sp24" * (self.form == "sp24")))

    def sp24_at(self, n: int) -> bool:
        """Whether ``n`` tokens (fp16, GPU) run the 2:4 kernel: up to ``sp24_max_n`` or from ``sp24_from_n`` (> 0)."""
        return (self.sp24_tiles is not None and n <= self.dense_above
                and (n <= self.sp24_max_n or 0 < self.sp24_from_n <= n))

    # forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dc = self.dense_copy
        if (dc is not None and self.bias is None and x.dtype == dc.dtype and x.is_cuda
                and x.numel() > self.dense_above * self.in_features):
            # above the crossover with a dense copy: the dense layer's own call, nothing else (the path below costs a
            # few us more per linear; issue 20: the demo's packed prefill was 0.95-0.97x dense on the same copies)
            return F.linear(x, dc)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        n = x2.shape[0]
        if x2.is_cuda:
            if self.sp24_at(n) and x2.dtype == torch.float16 and kernels_ready():
                return self.sp24_forward(x2).reshape(*lead, self.out_features)
            elif self.sp24_only:   # prefill, another dtype, or no kernels: the layout decoded (no TCA-BME form)
                y = sp24_dense_linear(self, x2, kernels_ready())
            elif (n <= self.dense_above and x2.dtype == torch.float16 and self.values.dtype == torch.float16
                    and kernels_ready()):
                return self.kernel_forward(x2).reshape(*lead, self.out_features)
            elif self.dense_copy is not None and x2.dtype == self.dense_copy.dtype:  # kept by dispatch
                y = F.linear(x2, self.dense_copy)
            elif torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
                # inside a compiled / captured step (no kernel, or a batch above dense_above): the decode kernel
                # in the op (sync-free: it reads through the offsets), else the sync-free torch decode
                if kernels_ready():
                    y = op_or_eager(tcabme_mm, tcabme_mm_eager)(x2, self.bitmaps, self.values, self.gtile_offsets,
                                                                self.strip_offsets, self.out_features, False)
                else:
                    raw = TcaBme(bitmaps=self.bitmaps, values=self.values, gtile_offsets=self.gtile_offsets,
                                 strip_offsets=self.strip_offsets, shape=(self.out_features, self.in_features))
                    y = F.linear(x2, decode_dense(raw).to(x2.dtype))
            else:  # prefill: decode the tiles to a dense weight on the GPU (one kernel), then cuBLAS
                y = F.linear(x2, self.dense_weight(x2.dtype))
        elif torch.compiler.is_compiling():  # the reference path, as one op (decode + matmul)
            y = tcabme_mm(x2, self.bitmaps, self.values, self.gtile_offsets, self.strip_offsets,
                          self.out_features, False)
        else:  # the reference path, eager: the same op as the dense layer, so results are bit-equal
            notice_once(CPU_NOTICE if torch.cuda.is_available() else NO_GPU_NOTICE)
            w = self.dense_weight(x2.dtype)
            bias = None if self.bias is None else self.bias.to(x2.dtype)
            if self.transposed:  # GPT-2 Conv1D: addmm(b, x, W[in, out]) with a contiguous [in, out]
                wt = w.t().contiguous()
                y = x2 @ wt if bias is None else torch.addmm(bias, x2, wt)
            else:
                y = F.linear(x2, w, bias)   # bias fused as in nn.Linear (one rounding, not two)
            return y.reshape(*lead, self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


def release_kernel_caches() -> None:
    """Drop the bundled kernels' cached device views of packed weights.

    Those views keep their tensors alive; call this after packed weights are replaced or freed
    (``swap.densify``, ``fusion.equalize_packed_sizes``) so the memory really goes back. A process that
    never launched a kernel has nothing cached: numba is not imported for it (~0.6 s)."""
    launch = sys.modules.get("sparsekit.kernels.launch")
    if launch is not None:
        launch.clear_caches()
