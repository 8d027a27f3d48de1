"""The 2:4 tile-mosaic path of ``SparseLinear`` (issue 22).

:func:`enable_sp24` transcodes the TCA-BME weight of every ``SparseLinear`` of a model whose tiles are
all 2:4 or dense (``sparsekit.packed.sp24``) and keeps the layout beside it (non-persistent buffers:
nothing changes on disk). Those layers then run ``sparsekit.kernels.sp24.sp24_matmul`` (the sparse tensor
cores on 2:4 tiles, ``mma.sync`` on dense ones; Hopper's warpgroup kernel where it measured faster) on a
GPU wherever they would run the TCA-BME kernel (fp16, at most ``dense_above`` tokens) at the token counts
``SparseLinear.sp24_at`` allows (up to ``sp24_max_n``, and from ``sp24_from_n`` when set); prefill and the
CPU keep their paths (a layer with no other form decodes its layout there: ``sp24_dense_linear``). The dispatch
plan (``runtime.dispatch``, ``prefer="speed"``, under ``SPARSEKIT_SP24=1`` until the path is on by default) calls it
for the layers whose encode-time tile census fits, times both kernels, and keeps each layout only where the 2:4
kernel measures faster. With ``prefer="memory"`` a layer keeps one form: :func:`keep_only_sp24` frees its TCA-BME
buffers where the layout wins, and the 2:4 kernel then runs up to ``decode_above`` tokens; above them an all-2:4 layer
runs cuSPARSELt on its layout rewritten for it (``kernels.sp24_cslt``, where ``cslt_check`` passed), another the
layout decoded for cuBLAS.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.errors import SparsekitError, strict_mode
from sparsekit.packed.sp24 import Sp24Layout, to_dense, transcode

ALWAYS = 1 << 62   # more tokens than any call (a layer's 2:4 kernel up to it: at every count)
# A layer that keeps only its 2:4 layout (``keep_only_sp24``) runs its kernel up to this many tokens, and above
# decodes the layout (``kernels.sp24_decode``, one kernel) and runs cuBLAS. H100, x cuBLAS, kernel against decode +
# cuBLAS: with dense tiles (35% hybrid; the kernel is sp24_ws from 128 tokens, docs/kernels-notes.md "v38") 0.51-0.52
# against 0.40-0.49 at 256 tokens, 0.38-0.49 against 0.52-0.55 at 512, 0.46-0.53 against 0.81-0.83 at 2048; all-2:4
# (sp24_ws, "v37") 0.91-0.97 against 0.69-0.70 at 1024, 0.79-1.03 against 0.87-0.94 at 4096 (22016x4096 the one
# that stays with the kernel).
DECODE_ABOVE_HYBRID = 256
DECODE_ABOVE_24 = 2048
# An all-2:4 layer whose M and K are multiples of 64 runs cuSPARSELt above this many tokens instead
# (``runtime.cusparselt``, its plans kept, the product column-major in the fastest configuration), on a buffer its
# layout is rewritten into for the call (``kernels.sp24_cslt``: 75 us on 22016x4096, 16 on 4096x4096). H200
# (docs/kernels-notes.md "v40"), x cuBLAS, rewrite + cuSPARSELt against sp24_ws on 22016x4096 / 12288x4096 /
# 4096x11008 / 4096x4096: at 512 tokens 0.57 / 0.77 / 0.81 / 0.75 against 1.00 / 0.73 / 0.54 / 0.70; at 1024 1.02 /
# 1.08 / 1.08 / 1.02 against 0.99 / 0.98 / 0.96 / 0.88; at 2048 1.28 / 1.24 / 1.23 / 1.19 against 1.12 / 0.99 / 0.97 /
# 0.90. Weights of ``CSLT_LARGE`` weights or more keep the kernel up to ``CSLT_ABOVE_24_LARGE``.
CSLT_ABOVE_24 = 512
CSLT_ABOVE_24_LARGE = 1024
CSLT_LARGE = 1 << 26
# ``prefer="memory"`` keeps an all-2:4 layer's layout as its only form where the 2:4 kernel's decode time is within
# this factor of TCA-BME's and cuSPARSELt can take its prefill (4096x4096 on an H100: 0.99x, with cuSPARSELt's
# 1.02-1.19x cuBLAS from 1024 tokens on an H200 against TCA-BME's decode + cuBLAS at 0.7-0.8)
CSLT_FORM_SLACK = 1.03


def sp24_mm_eager(x: torch.Tensor, dense: torch.Tensor, sp: torch.Tensor, tiles: torch.Tensor, out_features: int,
                  slabs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x[N, K] @ W^T`` through the 2:4 mosaic kernel; ``slabs``: X as sp24_ws reads it (``runtime.slabs``).
    A compiled step takes it as the op ``sp24_mm``, eager calls this function itself
    (``sparse_linear.op_or_eager``): at a token count that ran before, through its kept launch (``sp24_planned``)."""
    from sparsekit.kernels.sp24 import sp24_matmul, sp24_planned

    y = None if slabs is not None or not x.is_cuda else sp24_planned(x, sp, dense, out_features)
    if y is not None:
        return y
    return sp24_matmul(x, Sp24Layout(dense=dense, sp=sp, tiles=tiles, shape=(out_features, x.shape[1])), slabs=slabs)


sp24_mm = torch.library.custom_op("sparsekit::sp24_mm", mutates_args=())(sp24_mm_eager)


@sp24_mm.register_fake
def _sp24_mm_fake(x, dense, sp, tiles, out_features, slabs=None):
    return x.new_empty((x.shape[0], out_features))


_CHECKED: dict[str, str | None] = {}


def kernel_check(device) -> None:
    """One small 2:4 + dense product through the kernel on ``device`` against float64 (once per device),
    so that a GPU or numba that cannot run ``mma.sp`` is found when the path is turned on, in one line."""
    key = str(device)
    if key not in _CHECKED:
        _CHECKED[key] = None
        try:
            g = torch.Generator().manual_seed(0)
            w = torch.randn(64, 128, generator=g).half()
            w[:, 64:] = torch.where(torch.arange(64 * 64).reshape(64, 64) % 4 < 2, w[:, 64:], 0).half()
            x = torch.randn(3, 128, generator=g).half()
            y = sp24_mm(x.to(device), *_tensors(transcode(w.to(device))), 64).cpu().double()
            ref = x.double() @ w.double().t()
            err = float((y - ref).norm() / ref.norm())
            if not err < 1e-2:
                _CHECKED[key] = f"its self-test product is off by {err:.3g} (relative)"
        except Exception as e:  # noqa: BLE001 - said in one line below
            _CHECKED[key] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    if _CHECKED[key]:
        raise SparsekitError(f"the 2:4 kernel cannot run on {key} ({_CHECKED[key]}): leave the layers on TCA-BME")


def forget_checks() -> None:
    """Forget which devices ``kernel_check`` passed (the next call checks again)."""
    _CHECKED.clear()


def _tensors(layout: Sp24Layout) -> tuple:
    return layout.dense, layout.sp, layout.tiles


def enable_sp24(model: nn.Module, only: set[str] | None = None) -> dict[str, str]:
    """Give every eligible ``SparseLinear`` of ``model`` (of the names in ``only``, if given) its 2:4
    layout; returns ``{layer: "sp24"}`` or ``{layer: why not}``. A layer with an unstructured tile is not
    eligible (it keeps TCA-BME), except under ``SPARSEKIT_STRICT=1``, where that is an error; one whose
    recorded tile census says so is not scanned. On a GPU the kernel first runs one checked product
    (``kernel_check``); if it cannot, that is an error, never a silent fallback."""
    from sparsekit.packed.sp24 import census_fits

    out: dict[str, str] = {}
    for name, m in model.named_modules():
        if not hasattr(m, "use_sp24") or (only is not None and name not in only):   # a SparseLinear
            continue
        if census_fits(getattr(m, "tile_census", None)) is False and not strict_mode():
            c = m.tile_census
            out[name] = (f"{c['other']} of its {sum(int(v) for v in c.values())} tiles are neither 2:4 nor dense "
                         "(recorded at encode): it keeps TCA-BME")
            continue
        if m.values.dtype != torch.float16:
            out[name] = f"values are {m.values.dtype}: the 2:4 kernel takes fp16"
            continue
        try:
            layout = transcode(m.packed)
        except SparsekitError as e:
            if strict_mode():
                raise SparsekitError(f"{name}: {e} (SPARSEKIT_STRICT is set)") from None
            out[name] = str(e)
            continue
        if m.values.is_cuda:
            kernel_check(m.values.device)
        m.use_sp24(layout)
        out[name] = "sp24"
    return out


def layout_of(m) -> Sp24Layout:
    """The 2:4 layout a ``SparseLinear`` holds (``use_sp24``)."""
    return Sp24Layout(dense=m.sp24_dense, sp=m.sp24_sp, tiles=m.sp24_tiles, shape=(m.out_features, m.in_features))


def sp24_weight(m, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The ``[out, in]`` weight of a layer that keeps only its 2:4 layout, decoded from it (exact; torch ops)."""
    w = to_dense(layout_of(m))
    return w if dtype is None else w.to(dtype)


def sp24_dense_mm_eager(x: torch.Tensor, dense: torch.Tensor, sp: torch.Tensor, tiles: torch.Tensor,
                        out_features: int) -> torch.Tensor:
    """``x[N, K] @ W^T`` with W decoded from its 2:4 layout by the decode kernel, then cuBLAS (a compiled step takes
    it as the op ``sp24_dense_mm``)."""
    from sparsekit.kernels.sp24_decode import sp24_decode

    w = sp24_decode(Sp24Layout(dense=dense, sp=sp, tiles=tiles, shape=(out_features, x.shape[1])))
    return F.linear(x, w.to(x.dtype))


sp24_dense_mm = torch.library.custom_op("sparsekit::sp24_dense_mm", mutates_args=())(sp24_dense_mm_eager)


@sp24_dense_mm.register_fake
def _sp24_dense_mm_fake(x, dense, sp, tiles, out_features):
    return x.new_empty((x.shape[0], out_features))


def sp24_cslt_mm_eager(x: torch.Tensor, dense: torch.Tensor, sp: torch.Tensor, tiles: torch.Tensor,
                       out_features: int) -> torch.Tensor:
    """``x[N, K] @ W^T`` for an all-2:4 layout: rewritten into cuSPARSELt's buffer (``kernels.sp24_cslt``), then
    cuSPARSELt's product (a compiled step takes it as the op ``sp24_cslt_mm``)."""
    from sparsekit.kernels.sp24_cslt import sp24_to_cslt
    from sparsekit.runtime import cusparselt

    c = sp24_to_cslt(Sp24Layout(dense=dense, sp=sp, tiles=tiles, shape=(out_features, x.shape[1])))
    return cusparselt.mm(c, x, out_features)


sp24_cslt_mm = torch.library.custom_op("sparsekit::sp24_cslt_mm", mutates_args=())(sp24_cslt_mm_eager)


@sp24_cslt_mm.register_fake
def _sp24_cslt_mm_fake(x, dense, sp, tiles, out_features):
    n = x.shape[0]
    return x.new_empty((n, out_features))


_CSLT: dict[str, str | None] = {}


def cslt_check(device) -> str | None:
    """None if the cuSPARSELt path can serve 2:4 layers on ``device``, else why not (one phrase). Once per device:
    the transcode kernel's buffer of a small 2:4 weight must equal ``torch._cslt_compress``'s byte for byte (the
    layout of ``packed.cslt`` was read off one cuSPARSELt version) and its product (``runtime.cusparselt``) match
    float64. Its kept values are never zero: where a group holds fewer than two nonzeros, cuSPARSELt may keep other
    slots than ours (the same product, other bytes)."""
    from sparsekit.runtime import cusparselt
    from sparsekit.torch_compat import cslt_available, cslt_compress

    key = str(device)
    if key not in _CSLT:
        why = "not a CUDA device" if torch.device(device).type != "cuda" else cslt_available() or cusparselt.available()
        if why is None:
            try:
                from sparsekit.kernels.sp24_cslt import sp24_to_cslt

                g = torch.Generator().manual_seed(0)
                m, k = 16448, 192          # more than 128 row blocks and 8 groups of 4 past a 64-column tile
                keep = (torch.rand(m, k // 4, 4, generator=g).argsort(-1) < 2).reshape(m, k)
                v = torch.randn(m, k, generator=g)
                w = torch.where(keep, torch.where(v.abs() < 0.01, 1.0, v), 0).half().to(device)
                ours = sp24_to_cslt(transcode(w))
                x = torch.randn(37, k, generator=g).half().to(device)
                ref = x.double() @ w.double().t()
                err = float((cusparselt.mm(ours, x, m).double() - ref).norm() / ref.norm())
                if not torch.equal(ours.view(torch.int16), cslt_compress(w).view(torch.int16)):
                    why = "this cuSPARSELt lays out its compressed weights otherwise than sparsekit.packed.cslt"
                elif not err < 1e-2:
                    why = f"its self-test product is off by {err:.3g} (relative)"
            except Exception as e:  # noqa: BLE001 - said in one line by the caller
                why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        _CSLT[key] = why
    return _CSLT[key]


def cslt_off(m) -> str | None:
    """Why layer ``m`` (its 2:4 layout) does not take the cuSPARSELt path, in one phrase; None if it does. Its tiles
    must all be 2:4, M and K multiples of 64, the layout on a GPU where ``cslt_check`` passed."""
    if m.sp24_dense.numel():
        return "it has dense tiles"
    if m.out_features % 64 or m.in_features % 64:
        return f"{m.out_features}x{m.in_features} is not a multiple of 64"
    if not m.sp24_sp.is_cuda:
        return "not on a CUDA device"
    return cslt_check(m.sp24_sp.device)


def sp24_dense_linear(m, x: torch.Tensor, kernels: bool) -> torch.Tensor:
    """``x[N, K] @ W^T`` (no bias) for a layer that keeps only its 2:4 layout, where its kernel does not run (more than
    ``dense_above`` tokens, another dtype, no kernels): cuSPARSELt where ``keep_only_sp24`` found it usable
    (``sp24_cslt``), else the layout decoded, then cuBLAS. ``kernels``: the bundled kernels can run (the transcode or
    decode kernel, or inside a compiled step the ops ``sp24_cslt_mm`` / ``sp24_dense_mm``); else torch ops."""
    if kernels and x.is_cuda and getattr(m, "sp24_cslt", False) and x.dtype == torch.float16:
        fn = sp24_cslt_mm if torch.compiler.is_compiling() else sp24_cslt_mm_eager
        return fn(x, m.sp24_dense, m.sp24_sp, m.sp24_tiles, m.out_features)
    if kernels and x.is_cuda:
        fn = sp24_dense_mm if torch.compiler.is_compiling() else sp24_dense_mm_eager
        return fn(x, m.sp24_dense, m.sp24_sp, m.sp24_tiles, m.out_features)
    return F.linear(x, sp24_weight(m, x.dtype))


def decode_above(m) -> int:
    """The token count above which a layer that keeps only its 2:4 layout leaves its kernel for cuSPARSELt
    (``sp24_cslt``) or for its layout decoded and cuBLAS."""
    if getattr(m, "sp24_cslt", False):
        return CSLT_ABOVE_24_LARGE if m.out_features * m.in_features >= CSLT_LARGE else CSLT_ABOVE_24
    return DECODE_ABOVE_HYBRID if m.sp24_dense.numel() else DECODE_ABOVE_24


def above_path(m) -> str:
    """What a layer that keeps only its 2:4 layout runs above ``dense_above`` tokens, in words."""
    return "cuSPARSELt" if getattr(m, "sp24_cslt", False) else "decode + cuBLAS"


def keep_only_sp24(m) -> int:
    """``prefer="memory"`` (``runtime.dispatch``): make the 2:4 layout of ``SparseLinear`` ``m`` the only copy of its
    weight. Its TCA-BME buffers are freed (left empty), the 2:4 kernel runs up to ``decode_above`` tokens on a GPU,
    and above them cuSPARSELt (where ``cslt_off`` finds no reason: ``sp24_cslt``) or, as on the CPU (``to_linear``,
    ``dequantize``), the layout decoded (``sp24_dense_linear``). The layer has no TCA-BME form afterwards (``packed``
    says so). Returns the bytes freed."""
    if m.sp24_tiles is None:
        raise SparsekitError("keep_only_sp24 needs the layer's 2:4 layout first (use_sp24)")
    if m.sp24_only:
        return 0
    m._nnz = m.nnz                       # counted while the bitmaps are there
    freed = 0
    for name in ("bitmaps", "values", "gtile_offsets", "strip_offsets"):
        t = getattr(m, name)
        freed += t.numel() * t.element_size()
        setattr(m, name, t.new_empty(0))
    m.n_values = 0
    m._packed = m._packed_src = None
    m.sp24_only = True
    m.sp24_cslt = cslt_off(m) is None
    m.sp24_max_n, m.dense_above = ALWAYS, decode_above(m)
    return freed
