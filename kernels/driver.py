"""Kernel launches through the CUDA driver's C API (``cuLaunchKernelEx``, through ctypes) from argument buffers kept
per launch shape (issues 20-22: a prefill that runs layer by layer in Python is bound by the host's time a call).

A numba kernel takes every argument as an 8-byte word (an array as seven: meminfo, parent, item count, item size,
data pointer, shape, stride; ``compat_numba.flat``), so its arguments are one buffer of words, which the driver takes
whole (``CU_LAUNCH_PARAM_BUFFER_POINTER``). A ``Packed`` launch keeps that buffer, the grid, the block, the dynamic
shared memory and the cluster; a call writes the words that change (the tensors' addresses) and launches: a few us of
host time, against ~20-40 us for cuda.core's conversion of ~50 Python arguments a call. Inside a CUDA-graph capture
the driver copies the words into the graph's node, so a later call that rewrites them leaves the graph as it was.

The functions are loaded from ``libcuda.so.1`` on first use (a GPU machine only); ``available()`` says why not.
"""
from __future__ import annotations

import ctypes

CU_LAUNCH_PARAM_END = 0
CU_LAUNCH_PARAM_BUFFER_POINTER = 1
CU_LAUNCH_PARAM_BUFFER_SIZE = 2
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value (a cluster's x, y, z first)."""
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("value", ctypes.c_uint32 * 16)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``: the grid and block (x, y, z each), dynamic shared bytes, stream, attributes."""
    _fields_ = [("grid_x", ctypes.c_uint32), ("grid_y", ctypes.c_uint32), ("grid_z", ctypes.c_uint32),
                ("block_x", ctypes.c_uint32), ("block_y", ctypes.c_uint32), ("block_z", ctypes.c_uint32),
                ("shared_bytes", ctypes.c_uint32), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint32)]


_lib = None
_why: str | None = None


def available() -> str | None:
    """None if the driver's ``cuLaunchKernelEx`` is loaded (loading it on the first call), else why not."""
    global _lib, _why
    if _lib is None and _why is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernelEx
            fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuGetErrorName.restype = ctypes.c_int
            _lib = lib
        except (OSError, AttributeError) as e:
            _why = f"the CUDA driver's cuLaunchKernelEx cannot be loaded ({e})"
    return _why


def error_name(rc: int) -> str:
    name = ctypes.c_char_p()
    if _lib is None or _lib.cuGetErrorName(rc, ctypes.byref(name)) or not name.value:
        return f"CUresult {rc}"
    return name.value.decode()


class Packed:
    """One launch shape of one function: ``words`` (a ctypes array of 8-byte argument words; write the ones that
    change before ``launch``), ``blocks`` in clusters of ``cluster`` (1: none), ``threads`` a block, ``dyn`` bytes of
    dynamic shared memory. ``func``: the CUfunction or CUkernel address."""

    __slots__ = ("func", "words", "size", "extra", "attr", "config")

    def __init__(self, func: int, blocks: int, threads: int, dyn: int, nwords: int, cluster: int = 1):
        if blocks < 1 or threads < 1 or cluster < 1 or blocks % cluster:
            raise ValueError(f"{blocks} blocks of {threads} threads do not make clusters of {cluster}")
        self.func = ctypes.c_void_p(func)
        self.words = (ctypes.c_uint64 * nwords)()
        self.size = ctypes.c_size_t(8 * nwords)
        self.extra = (ctypes.c_void_p * 5)(CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(self.words),
                                           CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(self.size),
                                           CU_LAUNCH_PARAM_END)
        self.attr = LaunchAttribute(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, 0, (ctypes.c_uint32 * 16)(cluster, 1, 1))
        attrs = ctypes.pointer(self.attr) if cluster > 1 else None
        self.config = LaunchConfig(blocks, 1, 1, threads, 1, 1, dyn, None, attrs, 1 if cluster > 1 else 0)

    def launch(self, stream: int) -> None:
        """Launch on ``stream`` (a ``cudaStream_t`` as an integer; 0: the legacy default stream)."""
        self.config.stream = stream
        rc = _lib.cuLaunchKernelEx(ctypes.byref(self.config), self.func, None, self.extra)
        if rc:
            raise RuntimeError(f"cuLaunchKernelEx failed: {error_name(rc)} ({self.config.grid_x} blocks of "
                               f"{self.config.block_x} threads, {self.config.shared_bytes} bytes of shared memory)")

    def copy(self) -> "Packed":
        """A launch of its own with the same shape and words (write its words without touching this one's)."""
        c = self.config
        cluster = self.attr.value[0] if c.num_attrs else 1
        other = Packed(self.func.value, c.grid_x, c.block_x, c.shared_bytes, len(self.words), cluster)
        other.words[:] = self.words[:]
        return other
