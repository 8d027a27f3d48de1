"""Public entry points: ``tcabme_matmul`` (checks, padding, output) and ``kernels_available``."""
from __future__ import annotations

import os

import torch

_available: bool | None = None
_choice: str | None = None
_ws_ok: bool | None = None
KERNELS = ("default", "warp", "rows", "ws")
WS_MIN_N, WS_MIN_MK = 32, 1 << 26    # the default plan takes spmm_ws on Hopper from 32 tokens on weights this large
WS_WIDE_N, WS_WIDE_MK = 64, 1 << 25   # and from 64 on these (H100 sweep, docs/kernels-notes.md "v20")


def reset_kernel_choice() -> None:
    """Forget the choice read from ``SPARSEKIT_KERNEL`` and spmm_ws's self-test result: the next call reads
    the variable again and tests spmm_ws again (and the launches kept for eager calls, made under the old choice)."""
    import sys

    global _choice, _ws_ok
    _choice = None
    _ws_ok = None
    launch = sys.modules.get(f"{__package__}.launch")
    if launch is not None:
        launch.planned.clear()


def kernel_choice() -> str:
    """The TCA-BME kernel ``tcabme_matmul`` runs: ``SPARSEKIT_KERNEL`` (read here only, once per
    process): unset or ``default`` is the default plan (``default_kernel``); ``warp`` spmm_warp / spmm.py's
    launch plan only, ``rows`` the opt-in spmm_rows, ``ws`` spmm_ws (Hopper) at every token count; a choice
    other than the default is said once on stderr."""
    global _choice
    if _choice is None:
        raw = os.environ.get("SPARSEKIT_KERNEL", "default") or "default"
        if raw not in KERNELS:
            from sparsekit.errors import SparsekitError

            raise SparsekitError(f"SPARSEKIT_KERNEL={raw!r}: expected one of {', '.join(KERNELS)}")
        if raw != "default":
            import sys

            print(f"note: SPARSEKIT_KERNEL={raw}: TCA-BME products run the spmm_{raw} kernel only",
                  file=sys.stderr)
        _choice = raw
    return _choice


def default_kernel(device: torch.device, m: int, k: int, n: int) -> str:
    """The default plan's kernel for an ``m x k`` weight at ``n`` tokens: spmm_ws (decoded once per tile, its
    time nearly flat in the tokens) on Hopper from WS_MIN_N tokens on the largest weights and from WS_WIDE_N on
    large ones, where it beat spmm_warp on the H100; spmm_warp elsewhere."""
    from . import launch
    from .common import SIM

    return "ws" if ws_wanted(m, k, n) and not SIM and launch.hopper(device) and ws_checked(device) else "warp"


def planned_kernel(device: torch.device, m: int, kp: int, n: int, kernel: str | None = None) -> str:
    """The kernel ``tcabme_matmul`` runs without tuning keywords for an ``m x kp`` weight (K padded to 64) at
    ``n`` tokens: ``kernel``, else ``SPARSEKIT_KERNEL``'s choice; "default" is the default plan's."""
    kernel = kernel or kernel_choice()
    return default_kernel(device, m, kp, n) if kernel == "default" else kernel


def slab_tokens(device: torch.device, m: int, k: int, n: int) -> int:
    """The tokens a tile of the X slabs that ``tcabme_matmul`` (no tuning) reads for an ``m x k`` weight at ``n``
    tokens, where its kernel is spmm_ws (``sp24_ws.x_slabs`` at that width); 0 where the kernel reads X itself."""
    from . import launch
    from .spmm_ws_plan import ws_plan

    kp = -(-k // 64) * 64
    if n < 1 or planned_kernel(device, m, kp, n) != "ws":
        return 0
    return ws_plan(m, kp // 64, n, launch.sm_count(device))[0].nt   # spmm_ws's own plan, as it will launch


def ws_checked(device: torch.device) -> bool:
    """Whether spmm_ws passed its self-test here: one small product against the reference, run at the first
    call that would take spmm_ws (not at load: models without large weights never compile it). Inside a CUDA
    graph capture an unchecked spmm_ws is not used (the check cannot run there). A failure, or spmm_ws left
    out of a capture, is said once (an error under SPARSEKIT_STRICT=1): spmm_warp runs instead."""
    global _ws_ok
    if _ws_ok is None:
        from . import compat_numba, launch

        if launch._capturing():
            compat_numba.lost("spmm_ws in this CUDA graph (it was not self-tested before the capture)",
                              "spmm_warp runs in it")
            return False
        try:
            ws_self_test(device)
            _ws_ok = True
        except Exception as e:  # noqa: BLE001 - said once (raised under SPARSEKIT_STRICT); spmm_warp runs
            _ws_ok = False
            compat_numba.lost("the spmm_ws kernel (its self-test failed; spmm_warp runs instead)", e)
    return _ws_ok


def ws_self_test(device: torch.device) -> None:
    """One small spmm_ws product (32 tokens) against the reference; raises when it is off."""
    from sparsekit.packed.tcabme import encode

    from .reference import reference_matmul
    from .spmm_ws import tcabme_ws_matmul

    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    w = torch.where(torch.rand(64, 128, generator=g) < 0.5, torch.zeros_like(w), w).half()
    x = torch.randn(32, 128, generator=g).half().to(device)
    packed = encode(w.to(device))
    y = tcabme_ws_matmul(x, packed)
    ref = reference_matmul(x, packed).float()
    err = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-6))
    if not err < 1e-2:
        raise RuntimeError(f"its product is off by {err:.3g} (relative)")


def ws_wanted(m: int, k: int, n: int) -> bool:
    """Whether the default plan takes spmm_ws for an ``m x k`` weight at ``n`` tokens on Hopper."""
    return n >= WS_MIN_N and m * k >= WS_MIN_MK or n >= WS_WIDE_N and m * k >= WS_WIDE_MK


def kernels_available() -> bool:
    """True when a CUDA GPU is visible to torch and numba's CUDA target can use it."""
    global _available
    if _available is None:
        _available = False
        if torch.cuda.is_available() and os.environ.get("NUMBA_ENABLE_CUDASIM", "0") != "1":
            try:
                from numba import cuda

                _available = bool(cuda.is_available())
            except Exception:  # numba-cuda missing or broken: the reference path is used
                _available = False
    return _available


def tcabme_matmul(x: torch.Tensor, w, out: torch.Tensor | None = None, slabs: torch.Tensor | None = None,
                  **tuning) -> torch.Tensor:
    """``y[N, M] = x[N, K] @ W^T`` for a TCA-BME weight ``w`` (fp16 in, fp32 accumulate, fp16 out).

    ``x``: fp16, 2-D, on the same CUDA device as ``w``. The kernel runs on
    ``torch.cuda.current_stream()``, so calls can be captured in a CUDA graph (after one eager
    warm-up call per token count, which compiles the kernel). ``out``, if given, must be a
    contiguous fp16 ``[N, M]`` tensor. Under ``NUMBA_ENABLE_CUDASIM=1`` it runs CPU tensors through
    the simulator (slow; tests only). ``tuning`` (``splits``, ``cuda_core_max_n``) is for benchmarks;
    ``kernel="rows"`` (or ``SPARSEKIT_KERNEL=rows``) runs spmm_rows (a
    GroupTile row per block, the X slice shared by its 4 warps, K split across blocks), whose knobs are
    ``tokens`` (8/16/32/64 per block), ``splits``, ``stages``, ``regs``; ``kernel="ws"`` spmm_ws (Hopper;
    knobs ``tokens``, ``stages``, ``groups``, ``splits``, ``regs``); ``kernel="warp"`` spmm_warp's plan;
    ``kernel="default"`` the default plan (``default_kernel``) whatever ``SPARSEKIT_KERNEL`` says. ``slabs``: X
    already rewritten as spmm_ws reads it (``slab_tokens``), used where spmm_ws runs.
    """
    from . import launch
    from .common import SIM
    from .io import output_for, padded

    if x.dim() != 2:
        raise ValueError(f"tcabme_matmul expects x of shape [N, K], got {tuple(x.shape)}")
    m, k = w.shape
    n = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {k}")
    if x.dtype != torch.float16 or w.values.dtype != torch.float16:
        raise ValueError(f"tcabme_matmul needs fp16 x and values, got {x.dtype} and {w.values.dtype}")
    if not SIM and (not x.is_cuda or x.device != w.values.device):
        raise ValueError(f"x ({x.device}) and the packed weight ({w.values.device}) must share one CUDA device")
    # an eager call at a weight and token count that ran before (no keyword, no output given): its kept launch
    key = None if out is not None or slabs is not None or tuning or SIM else ("tcabme", w.bitmaps.data_ptr(),
                                                                              w.values.data_ptr(), n, k, m)
    y = None if key is None else launch.replay(key, x, m)
    if y is not None:
        return y
    out = output_for(x, m, out)
    if n == 0 or m == 0:
        return out
    kp = w.grid[1] * 64
    x0, x = x, padded(x, kp)      # (spmm_ws pads X itself: it takes x0)
    key = key if kp == k else None
    if kp == 0 or w.values.numel() == 0:   # nothing stored: the product is zero
        return out.zero_()
    kernel = tuning.pop("kernel", None)
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"unknown TCA-BME kernel {kernel!r}: one of {', '.join(KERNELS)}")
    if not tuning:
        kernel = planned_kernel(x.device, m, kp, n, kernel)
    if kernel == "rows":
        from .launch_rows import launch_rows

        launch_rows(x, w, out, **tuning)
    elif kernel == "ws":
        from .spmm_ws import tcabme_ws_matmul

        tcabme_ws_matmul(x0, w, out, slabs=slabs, record=key, **tuning)
    else:
        launch.launch(x, w, out, record=key, **tuning)
    return out
