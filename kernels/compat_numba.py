"""Every reach into numba / numba-cuda / cuda-core internals the kernels make, in one place.

Checked against: numba 0.68 with numba-cuda 0.30.4 and cuda-core (the GPU image), and numba 0.68.1
with its bundled CUDA target (the CPU/CI image, simulator only). Each reach is guarded: on a numba
where it fails, the caller keeps numba's own (slower or more limited) path; nothing here changes
what a kernel computes. What reaches in:

- ``numpy.row_stack`` restored (numba-cuda 0.30.4 still calls it; numpy 2.5 removed it);
- ``silence_low_occupancy_warnings``: both numba's and numba-cuda's config copies;
- ``cuda_typing``: numba-cuda >= 0.20 carries its own ``types`` / ``cgutils``, the bundled target uses
  numba.core's;
- ``sim_kernel`` / ``sim_syncthreads``: the simulator's per-launch kernel context (``_get_kernel_context``);
- ``opt_in_smem``: ``Dispatcher._compile_for_args`` + the code library's ``CUfunction`` +
  ``cuKernelSetAttribute`` (dynamic shared memory past 48 KB);
- ``fast_entry`` / ``launch_direct`` / ``flat``: numba's kernel argument packing (checked once per
  kernel against ``_Kernel._prepare_args``) and a direct ``cuda.core.launch`` of the compiled kernel
  (``grid`` counts clusters from cuda-core 0.4.0 on, blocks before); ``handle_of``: that kernel's driver handle
  (cuda.core's public ``Kernel.handle``), which ``driver.Packed`` launches where the driver's C API is loaded;
- ``cubin_of`` / ``load_cubin`` / ``set_max_dyn_smem``: the compiled kernel's code library (its cubin
  and entry name) for ``kcache``, and cuda.core's ``ObjectCode`` to load it back.

Importing this module imports numpy only; numba is imported on first use.
"""
from __future__ import annotations

import ctypes

import numpy

if not hasattr(numpy, "row_stack"):
    numpy.row_stack = numpy.vstack

_cfgs: dict = {}          # (blocks, threads, dynamic shared bytes) -> cuda.core LaunchConfig
_sim_context = None


def silence_low_occupancy_warnings() -> None:
    """Turn off numba's "grid size N will likely result in GPU under-utilization" warning (split-K
    grids for small layers are deliberately small; it would fire on every such launch)."""
    from numba import config as numba_config

    numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = False
    try:  # numba-cuda (the separate package) reads its own copy of the config
        from numba.cuda.core import config as numba_cuda_config

        numba_cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = False
    except ImportError:
        pass


def cuda_typing():
    """(types, cgutils) for ``numba.cuda.extending.intrinsic`` code generation."""
    try:  # numba-cuda >= 0.20 carries its own type system
        from numba.cuda import cgutils, types
    except ImportError:  # the CUDA target bundled with numba
        from numba.core import cgutils, types
    return types, cgutils


def sim_kernel() -> object:
    """The simulator's per-launch ``cuda`` module of the running kernel (simulator only). Helpers in
    another module than the kernel use it instead of ``cuda``: the simulator swaps ``cuda`` in a device
    function's module globals per call, which races between its threads."""
    global _sim_context
    if _sim_context is None:
        from numba.cuda.simulator.kernel import _get_kernel_context

        _sim_context = _get_kernel_context
    return _sim_context()


def sim_syncthreads() -> None:
    """``cuda.syncthreads()`` of the simulated thread running this call (simulator only)."""
    sim_kernel().syncthreads()


def opt_in_smem(kern, args, nbytes: int) -> bool:
    """Let ``kern`` (compiled for ``args``) take up to ``nbytes`` of dynamic shared memory; False
    where this numba cannot (the caller stays under 48 KB)."""
    try:
        k = kern._compile_for_args(*args)
        cufunc = k._codelibrary.get_cufunc()
        _set_dyn_smem(cufunc.handle, nbytes, cufunc.device.id)
        return True
    except Exception as e:  # noqa: BLE001 - said once (raised under SPARSEKIT_STRICT): stay under 48 KB
        lost("shared memory past 48 KB per block (fewer pipeline stages)", e)
        return False


def _set_dyn_smem(handle, nbytes: int, device_id: int) -> None:
    from numba.cuda.cudadrv.driver import binding, driver

    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, handle, device_id)


def set_max_dyn_smem(ck, nbytes: int, device_id: int) -> bool:
    """Let the cuda.core kernel ``ck`` (see ``load_cubin``) take up to ``nbytes`` of dynamic shared
    memory; False where it cannot (the caller compiles through numba, which says why)."""
    try:
        _set_dyn_smem(ck.handle, nbytes, device_id)
        return True
    except Exception:  # noqa: BLE001 - numba's own opt-in runs next and reports the failure once
        return False


def cubin_of(kern, args) -> tuple[bytes, str] | None:
    """``(cubin, entry name)`` of ``kern`` as compiled for ``args``, or None where its module needs
    numba's set-up or tear-down on load (then it cannot be loaded without numba)."""
    lib = kern._compile_for_args(*args)._codelibrary
    if getattr(lib, "_setup_functions", None) or getattr(lib, "_teardown_functions", None):
        return None
    code = lib.get_cubin()
    data = getattr(code, "code", code)     # numba-cuda 0.30 links with cuda.core: an ObjectCode holding bytes
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"its linked code is a {type(data).__name__}, not cubin bytes")
    return bytes(data), lib._entry_name


_objects: list = []   # loaded cubins stay loaded for the process (their kernels are cached by the launcher)


def load_cubin(cubin: bytes, entry: str):
    """The cuda.core kernel ``entry`` of ``cubin``, loaded into this process."""
    from cuda.core import ObjectCode

    obj = ObjectCode.from_cubin(cubin)
    kernel = obj.get_kernel(entry)
    _objects.append(obj)
    return kernel


_lost_said: set[str] = set()


def lost(feature: str, why: Exception | str) -> None:
    """A faster path this numba does not allow: one ``SparsekitWarning`` per process naming it and why,
    or a ``SparsekitError`` under ``SPARSEKIT_STRICT=1``. Never silent."""
    import warnings

    import numba

    from sparsekit.errors import SparsekitError, SparsekitWarning, strict_mode

    reason = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
    msg = f"numba {getattr(numba, '__version__', '?')}: {feature} is off ({reason})"
    if strict_mode():
        raise SparsekitError(f"{msg} (SPARSEKIT_STRICT is set: no fallback)")
    if msg not in _lost_said:
        _lost_said.add(msg)
        warnings.warn(msg, SparsekitWarning, stacklevel=3)


def flat(ptr: int, size: int, itemsize: int) -> list:
    """A 1-D contiguous device array as numba passes it to a kernel: meminfo, parent, item count,
    item size, data pointer, shape, strides."""
    return [0, 0, size, itemsize, ptr, size, itemsize]


def fast_entry(kern, args):
    """The cuda.core kernel behind ``kern`` if launching it directly passes exactly the arguments
    numba's own launch would (checked once per kernel against numba's argument packing); else None.
    ``args``: numba device arrays (1-D, contiguous) first, then int64 scalars.

    numba's launch (type checks, a device-array wrapper per tensor) costs ~0.3 ms per call from
    Python, 25x this kernel at decode shapes; it matters wherever the product is not replayed
    from a CUDA graph (prefill, eager decode).
    """
    try:
        ck = kern._compile_for_args(*args)
        ref: list = []
        for t, v in zip(ck.argument_types, args):
            ck._prepare_args(t, v, 0, [], ref)
        mine: list = []
        for a in args:
            if hasattr(a, "device_ctypes_pointer"):
                mine += flat(a.device_ctypes_pointer.value or 0, a.size, a.dtype.itemsize)
            else:
                mine.append(ctypes.c_int64(a))
        same = [getattr(a, "value", a) for a in ref] == [getattr(a, "value", a) for a in mine]
    except Exception as e:  # noqa: BLE001 - said once (raised under SPARSEKIT_STRICT): numba's own launch
        lost(FAST_LAUNCH, e)
        return None
    if not same:
        lost(FAST_LAUNCH, "its kernel argument packing differs from the one checked")
        return None
    return ck._codelibrary.get_cufunc().kernel


def handle_of(ck) -> int:
    """The driver's handle (a ``CUkernel`` address, which ``cuLaunchKernelEx`` takes for a ``CUfunction``) of the
    cuda.core kernel ``ck`` (``fast_entry``, ``load_cubin``)."""
    return int(ck.handle)


FAST_LAUNCH = "the direct kernel launch (numba's own launch costs ~0.3 ms more per eager call)"


def _grid_counts_clusters() -> bool:
    """cuda.core 0.4.0 changed ``LaunchConfig.grid`` to count clusters when ``cluster`` is set (it
    counted blocks before, NVIDIA/cuda-python#867)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(v) for v in version("cuda-core").split(".")[:2])
    except (PackageNotFoundError, ValueError):  # a source tree or an odd version string: a current release
        return True
    return (major, minor) >= (0, 4)


def launch_direct(ck, blocks: int, threads: int, dyn: int, stream, flat_args, scalars, cluster: int = 1) -> None:
    """Launch the cuda.core kernel ``ck`` with numba's argument packing: ``flat_args`` (the arrays,
    see ``flat``) then ``scalars`` as int64; ``cluster`` > 1: ``blocks`` in clusters of that many."""
    from cuda.core import LaunchConfig
    from cuda.core import launch as cc_launch

    key = (blocks, threads, dyn, cluster)
    cfg = _cfgs.get(key)
    if cfg is None:
        grid = blocks // cluster if cluster > 1 and _grid_counts_clusters() else blocks
        cfg = _cfgs[key] = (LaunchConfig(grid=grid, cluster=cluster, block=threads, shmem_size=dyn)
                            if cluster > 1 else LaunchConfig(grid=blocks, block=threads, shmem_size=dyn))
    cc_launch(stream, cfg, ck, *flat_args, *[ctypes.c_int64(s) for s in scalars])
