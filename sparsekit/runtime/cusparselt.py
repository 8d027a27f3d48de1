"""cuSPARSELt's 2:4 product called through its public C API (ctypes), with its plans kept per problem.

``torch._cslt_sparse_mm`` builds and drops a cuSPARSELt plan on every call: 0.5-1.5 ms of host time on an H100 at
any token count, more than its kernel takes up to ~2048 tokens, so an eager prefill that calls it per layer is bound
by the host (docs/kernels-notes.md "v39"). Here a plan is made once per (device, M, K, padded N) and reused: a call is
then one ``cusparseLtMatmul``, ~15 us of host time.

- **Output layout.** The product is written column-major ``[M, Np]``, which is a contiguous row-major ``[N, M]``: the
  layout the next ops expect. torch's route writes ``[M, N]`` row-major and hands back a transposed view; in a model
  that view sent attention to its slow math path and made the elementwise ops strided (a 2:4 7B-shaped prefill ran
  0.66-0.74x dense that way, 1.07-1.20x this way).
- **Algorithm.** cuSPARSELt's default configuration for that layout took 2-3x the best one; on a plan's first call the
  first ``SEARCH_IDS`` configurations are timed on the call's own operands (milliseconds, once per problem) and the
  fastest is kept. A call that makes a plan synchronizes the device and cannot be captured in a CUDA graph (prefill
  runs eagerly; decode never comes here).

The library is the one torch loads (``libcusparseLt.so.0``, from the ``nvidia-cusparselt`` wheel torch depends on).
The sparse descriptor is the one under which ``torch._cslt_compress`` lays its buffer out (``[M, K]`` row-major,
leading dimension K, 16-byte alignment, fp16): ``sparsekit.packed.cslt`` writes that layout down and
``runtime.sp24.cslt_check`` compares a buffer written from a 2:4 layout with the library's own before it is used.
Constants are those of cuSPARSELt 0.8 (``cusparseLt.h``: the opaque structs are 512 bytes; ``CUSPARSE_COMPUTE_32F``
is 2) and of CUDA's ``library_types.h`` / ``cusparse.h``; ``available()`` checks the version against ``SUPPORTED``.
"""
from __future__ import annotations

import ctypes
import os
from collections import OrderedDict

import torch

from sparsekit.torch_compat import raw_stream

SUPPORTED = (800, 999)          # cuSPARSELt 0.8.0 up to 0.9.x: the struct size and enums below
_STRUCT = 512
_R_16F, _ORDER_COL, _ORDER_ROW, _NON_T, _T, _SPARSITY_50, _COMPUTE_32F, _ALG_DEFAULT = 2, 1, 2, 0, 1, 0, 2, 0
_ALG_ID, _ALG_MAX_ID = 0, 1     # cusparseLtMatmulAlgAttribute_t: CONFIG_ID, CONFIG_MAX_ID
MAX_PLANS = 64
SEARCH_IDS = 12      # configurations 0-11: each ran correctly on the 7B shapes (a sweep past them crashed)

_LIB: list = []
_HANDLES: dict[int, ctypes.Array] = {}
_PLANS: OrderedDict = OrderedDict()


def _opaque() -> ctypes.Array:
    return (ctypes.c_uint8 * (_STRUCT + 16))()        # one spare aligned slot: alignas(16) in the header


def _ptr(buf: ctypes.Array) -> ctypes.c_void_p:
    addr = ctypes.addressof(buf)
    return ctypes.c_void_p(addr + (-addr) % 16)


def _load():
    if _LIB:
        return _LIB[0]
    lib, errors = None, []
    names = ["libcusparseLt.so.0"]
    try:
        import nvidia.cusparselt as pkg          # the wheel torch depends on

        names += [os.path.join(p, "lib", "libcusparseLt.so.0") for p in pkg.__path__]
    except ImportError:
        pass
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as e:
            errors.append(str(e))
    if lib is None:
        raise OSError(f"libcusparseLt.so.0 not found ({'; '.join(errors)[:200]})")
    for fn in ("cusparseLtInit", "cusparseLtStructuredDescriptorInit", "cusparseLtDenseDescriptorInit",
               "cusparseLtMatmulDescriptorInit", "cusparseLtMatmulAlgSelectionInit", "cusparseLtMatmulAlgGetAttribute",
               "cusparseLtMatmulAlgSetAttribute", "cusparseLtMatmulPlanInit", "cusparseLtMatmulGetWorkspace",
               "cusparseLtMatmul", "cusparseLtGetVersion"):
        getattr(lib, fn).restype = ctypes.c_int
    i64, u32, i32, vp = ctypes.c_int64, ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p
    lib.cusparseLtMatmulAlgGetAttribute.argtypes = [vp, vp, i32, vp, ctypes.c_size_t]
    lib.cusparseLtMatmulAlgSetAttribute.argtypes = [vp, vp, i32, vp, ctypes.c_size_t]
    lib.cusparseLtStructuredDescriptorInit.argtypes = [vp, vp, i64, i64, i64, u32, i32, i32, i32]
    lib.cusparseLtDenseDescriptorInit.argtypes = [vp, vp, i64, i64, i64, u32, i32, i32]
    lib.cusparseLtMatmulDescriptorInit.argtypes = [vp, vp, i32, i32, vp, vp, vp, vp, i32]
    lib.cusparseLtMatmulAlgSelectionInit.argtypes = [vp, vp, vp, i32]
    lib.cusparseLtMatmulPlanInit.argtypes = [vp, vp, vp, vp]
    lib.cusparseLtMatmulGetWorkspace.argtypes = [vp, vp, ctypes.POINTER(ctypes.c_size_t)]
    lib.cusparseLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(vp), i32]
    _LIB.append(lib)
    return lib


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"cuSPARSELt {what} failed (status {status})")


def version() -> int:
    """cuSPARSELt's version as ``major * 1000 + minor * 100 + patch`` (0.8.0 -> 800)."""
    lib = _load()
    v = ctypes.c_int(0)
    lib.cusparseLtGetVersion.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    _check(lib.cusparseLtGetVersion(_ptr(_handle()), ctypes.byref(v)), "cusparseLtGetVersion")
    return v.value


def available() -> str | None:
    """None if this module can run cuSPARSELt here, else why not (one phrase)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        v = version()
    except (OSError, RuntimeError, AttributeError) as e:
        return str(e).splitlines()[0][:200]
    if not SUPPORTED[0] <= v <= SUPPORTED[1]:
        return f"cuSPARSELt {v} is not one sparsekit.runtime.cusparselt was checked with ({SUPPORTED})"
    return None


def _handle(dev: int | None = None) -> ctypes.Array:
    dev = torch.cuda.current_device() if dev is None else dev
    if dev not in _HANDLES:
        h = _opaque()
        with torch.cuda.device(dev):
            _check(_load().cusparseLtInit(_ptr(h)), "cusparseLtInit")
        _HANDLES[dev] = h
    return _HANDLES[dev]


class _Plan:
    """A matmul plan for ``D = A[M, K] (2:4, the compressed buffer) @ B^T`` with ``B = x[Np, K]`` row-major and D
    ``[M, Np]`` column-major: the memory of a row-major ``y[Np, M]``, so the product needs no transpose after it.
    ``alg_id``: cuSPARSELt's algorithm configuration (None: its default)."""

    def __init__(self, dev: int, m: int, k: int, np_: int, alg_id: int | None = None):
        lib, h = _load(), _ptr(_handle(dev))
        self.bufs = [_opaque() for _ in range(6)]
        a, b, c, mm, alg, plan = (_ptr(x) for x in self.bufs)
        _check(lib.cusparseLtStructuredDescriptorInit(h, a, m, k, k, 16, _R_16F, _ORDER_ROW, _SPARSITY_50),
               "sparse descriptor")
        _check(lib.cusparseLtDenseDescriptorInit(h, b, np_, k, k, 16, _R_16F, _ORDER_ROW), "dense descriptor")
        _check(lib.cusparseLtDenseDescriptorInit(h, c, m, np_, m, 16, _R_16F, _ORDER_COL), "output descriptor")
        _check(lib.cusparseLtMatmulDescriptorInit(h, mm, _NON_T, _T, a, b, c, c, _COMPUTE_32F), "matmul descriptor")
        _check(lib.cusparseLtMatmulAlgSelectionInit(h, alg, mm, _ALG_DEFAULT), "algorithm selection")
        v = ctypes.c_int(0)
        _check(lib.cusparseLtMatmulAlgGetAttribute(h, alg, _ALG_MAX_ID, ctypes.byref(v), 4), "max algorithm id")
        self.max_alg = v.value
        if alg_id is not None:
            v = ctypes.c_int(alg_id)
            _check(lib.cusparseLtMatmulAlgSetAttribute(h, alg, _ALG_ID, ctypes.byref(v), 4), "algorithm id")
        _check(lib.cusparseLtMatmulPlanInit(h, plan, mm, alg), "plan")
        ws = ctypes.c_size_t(0)
        _check(lib.cusparseLtMatmulGetWorkspace(h, plan, ctypes.byref(ws)), "workspace size")
        self.plan, self.h, self.workspace = plan, h, int(ws.value)

    def run(self, compressed: torch.Tensor, xp: torch.Tensor, out: torch.Tensor) -> None:
        ws = torch.empty(max(self.workspace, 1), dtype=torch.uint8, device=xp.device)
        stream = ctypes.c_void_p(raw_stream(xp.device))
        _check(_load().cusparseLtMatmul(self.h, self.plan, ctypes.byref(_ALPHA), ctypes.c_void_p(compressed.data_ptr()),
                                        ctypes.c_void_p(xp.data_ptr()), ctypes.byref(_BETA),
                                        ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                        ctypes.c_void_p(ws.data_ptr()), ctypes.byref(stream), 1), "cusparseLtMatmul")


_ALPHA, _BETA = ctypes.c_float(1.0), ctypes.c_float(0.0)


def _chosen(dev: int, m: int, k: int, np_: int, compressed, xp, out) -> _Plan:
    """The plan for this problem: on its first call each of the first ``SEARCH_IDS`` algorithms is timed on the
    call's own operands (CUDA events; a few milliseconds, once) and the fastest kept; one that returns an error status
    is skipped, and where all do the default stays. (cuSPARSELt's default took 3x the best on the 7B shapes;
    ``cusparseLtMatmulSearch`` returned status 7.) Dropped plans are not destroyed (``cusparseLtMatmulPlanDestroy``
    is not called yet): each keeps its host memory, 12 a problem."""
    key = (dev, m, k, np_)
    p = _PLANS.get(key)
    if p is not None:
        _PLANS.move_to_end(key)
        return p
    with torch.cuda.device(dev):
        best, best_ms = _Plan(dev, m, k, np_), float("inf")
        for alg_id in range(min(SEARCH_IDS, best.max_alg + 1)):
            try:
                cand = _Plan(dev, m, k, np_, alg_id)
                cand.run(compressed, xp, out)
            except RuntimeError:         # a configuration this problem does not take (a status): the next one
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(2):
                cand.run(compressed, xp, out)
            end.record()
            end.synchronize()
            if start.elapsed_time(end) < best_ms:
                best, best_ms = cand, start.elapsed_time(end)
    _PLANS[key] = best
    while len(_PLANS) > MAX_PLANS:
        _PLANS.popitem(last=False)
    return best


def mm(compressed: torch.Tensor, x: torch.Tensor, m: int) -> torch.Tensor:
    """``x[N, K] @ W^T`` -> a contiguous ``[N, M]`` fp16 for W ``[m, K]`` given by its cuSPARSELt buffer
    ``compressed`` (fp16, ``packed.cslt`` layout, on x's GPU). N is padded to a multiple of 8 for the call."""
    n, k = x.shape
    if x.dtype != torch.float16 or compressed.dtype != torch.float16 or not x.is_cuda \
            or compressed.device != x.device or compressed.numel() != m * (k // 2 + k // 16) or k % 64 or m % 64:
        raise ValueError(f"cusparselt.mm takes fp16 tensors on one GPU, M and K multiples of 64 and a buffer of "
                         f"M * (K/2 + K/16) halves; got x {tuple(x.shape)} {x.dtype}, buffer "
                         f"{compressed.numel()} {compressed.dtype}, M {m}")
    np_ = n + (-n) % 8
    xp = x if np_ == n and x.is_contiguous() else torch.nn.functional.pad(x.contiguous(), (0, 0, 0, np_ - n))
    out = torch.empty((np_, m), dtype=torch.float16, device=x.device)
    _chosen(x.device.index, m, k, np_, compressed, xp, out).run(compressed, xp, out)
    return out[:n]
