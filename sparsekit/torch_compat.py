"""Every place sparsekit reaches past torch's stable public API, in one module (the twin of
``sparsekit.hf.compat`` for transformers).

Checked against torch 2.11 (the GPU image) and 2.13.0 (the CPU build CI installs), the range
``pyproject.toml`` admits:

* ``raise_recompile_limit``: ``torch._dynamo.config.recompile_limit`` (``cache_size_limit`` before
  2.6): how many compiled variants one function may keep.
* ``recompile_limit_raises`` / ``is_recompile_limit_hit``: ``torch._dynamo.config.fail_on_recompile_limit_hit``
  (``fail_on_cache_limit_hit`` before 2.6) and the ``FailOnRecompileLimitHit`` it raises, so that a compiled call
  that runs out of variants is an error, not the silent uncompiled run torch makes of it by default.
* ``start_compile_workers``: ``torch._inductor.async_compile.maybe_warm_pool``, the call with which
  Inductor starts its pool of compile worker processes at its first compile (checked on 2.13; on 2.11 the
  GPU run of ``eval --speed`` shows it: where it is missing, its notes say so).
* ``module_tensors`` / ``set_module_tensor``: swapping a module's own parameters and buffers for
  other tensors (moving layers between devices, streaming weights in), through public calls only:
  ``named_parameters(recurse=False)``, ``named_buffers(recurse=False)`` and attribute assignment,
  which ``nn.Module.__setattr__`` routes to the registered parameter or buffer.
* ``cslt_compress``: ``torch._cslt_compress``, cuSPARSELt's 2:4 compress (checked on 2.11 with cuSPARSELt 0.8.0 on
  an H100; the op exists on 2.13's CPU build, where it cannot run). Only the load-time self-check calls it
  (``runtime.sp24.cslt_check``): the buffer sparsekit writes from a 2:4 layout must equal it. The product goes through
  cuSPARSELt's own C API with kept plans (``runtime.cusparselt``): ``torch._cslt_sparse_mm`` makes a plan on every
  call, ~0.5-1.5 ms of host time.
* ``raw_stream``: ``torch._C._cuda_getCurrentRawStream(device index)``, the current stream's handle without building a
  ``torch.cuda.Stream`` (CUDA builds only: Inductor's generated code gets its stream with it, through
  ``torch._dynamo.device_interface``, on 2.11 and 2.13; the CPU build lacks it). Where it is missing, the public
  ``current_stream(device).cuda_stream``, ~3 us a call, where an eager launch through the driver is ~3-5 us in all
  (``kernels.launch``; ``runtime.cusparselt`` takes it the same way).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def raise_recompile_limit(at_least: int) -> None:
    """Let one compiled function keep at least ``at_least`` variants (torch's default, 8, is tight
    when several models or batch sizes are measured in one process)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), at_least))
            return
    raise RuntimeError(f"torch {torch.__version__} has neither torch._dynamo.config.recompile_limit nor "
                       "cache_size_limit: update sparsekit.torch_compat")


@contextlib.contextmanager
def recompile_limit_raises():
    """Within: a ``torch.compile``-d function that would need more variants than its recompile limit raises
    (``is_recompile_limit_hit`` tells the error) instead of running uncompiled with only a log line."""
    cfg = torch._dynamo.config
    for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(cfg, name):
            with cfg.patch(**{name: True}):
                yield
            return
    raise RuntimeError(f"torch {torch.__version__} has neither torch._dynamo.config.fail_on_recompile_limit_hit "
                       "nor fail_on_cache_limit_hit: update sparsekit.torch_compat")


def is_recompile_limit_hit(e: BaseException) -> bool:
    """Whether ``e`` is the error ``recompile_limit_raises`` makes torch raise."""
    return type(e).__name__ in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")


def recompile_limit() -> int:
    """How many variants one compiled function may keep (``raise_recompile_limit``)."""
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 0)))


def start_compile_workers() -> None:
    """Start Inductor's pool of compile worker processes now, in the background, as torch itself does
    only when its first compile begins (``torch._inductor.async_compile.maybe_warm_pool``). Until the
    pool answers, which takes seconds (a process that imports torch, then its workers), Inductor
    compiles each Triton kernel in this process, one after the other; started earlier, the pool is
    ready when the first kernels are. Idempotent; starts nothing where torch would start none (no
    Triton, ``TORCHINDUCTOR_COMPILE_THREADS=1``, ``TORCH_WARM_POOL=0``). Raises ``RuntimeError`` when
    this torch has no such call."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError as e:
        raise RuntimeError(f"torch {torch.__version__} has no torch._inductor.async_compile.maybe_warm_pool: "
                           "update sparsekit.torch_compat") from e
    maybe_warm_pool()


def own_tensors(mod: nn.Module) -> Iterator[tuple[nn.Module, str, str, torch.Tensor]]:
    """``(mod, kind, name, tensor)`` for ``mod``'s own parameters (kind ``"p"``) and buffers
    (``"b"``), not its submodules'; ``None`` entries skipped."""
    for name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
        yield mod, "p", name, p
    for name, b in mod.named_buffers(recurse=False, remove_duplicate=False):
        yield mod, "b", name, b


def module_tensors(module: nn.Module) -> Iterator[tuple[nn.Module, str, str, torch.Tensor]]:
    """:func:`own_tensors` of ``module`` and of each of its submodules (a tensor shared by several
    owners appears once per owner)."""
    for mod in module.modules():
        yield from own_tensors(mod)


def set_module_tensor(owner: nn.Module, kind: str, name: str, value: torch.Tensor) -> None:
    """Make ``value`` the parameter (``kind == "p"``: wrapped as a frozen ``nn.Parameter`` unless it is
    one) or the buffer (``"b"``) ``name`` of ``owner``."""
    if kind == "p" and not isinstance(value, nn.Parameter):
        value = nn.Parameter(value, requires_grad=False)
    setattr(owner, name, value)


def cslt_available() -> str | None:
    """None if cuSPARSELt's ops can run here, else why not (one phrase)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not hasattr(torch, "_cslt_compress"):
        return f"torch {torch.__version__} has no torch._cslt_compress: update sparsekit.torch_compat"
    try:
        if not torch.backends.cusparselt.is_available():
            return f"torch {torch.__version__} was built without cuSPARSELt"
    except AttributeError:
        return f"torch {torch.__version__} has no torch.backends.cusparselt"
    return None


def cslt_compress(w: torch.Tensor) -> torch.Tensor:
    """cuSPARSELt's compressed buffer of a dense 2:4 fp16 weight (``torch._cslt_compress``)."""
    return torch._cslt_compress(w)


def raw_stream(device: torch.device) -> int:
    """The handle (``cudaStream_t`` as an integer) of torch's current stream on the CUDA ``device``."""
    fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fn is None:
        return torch.cuda.current_stream(device).cuda_stream
    return fn(device.index if device.index is not None else torch.cuda.current_device())
