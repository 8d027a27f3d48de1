"""Device primitives the kernels need, in two forms chosen by ``SIM``: GPU and simulator.

On a GPU they are inline PTX / LLVM IR (``_intrinsics_ptx``: ``mma.sync`` m16n8k16, ``cvt``, warp
shuffles, Hopper bulk copies and mbarriers, ``cp.async`` waits); under ``NUMBA_ENABLE_CUDASIM=1``
plain Python with the same names and signatures (``_intrinsics_sim``: warp exchanges through a
per-block scratch array, ``mma`` an exact emulation of the fragment contract). This makes the
kernels' decode, fragment layout and epilogue testable without a GPU; what the simulator does not
cover is the PTX itself (instruction syntax, register constraints), which
``scripts/checks/gpu_kernels.py`` checks on the device.
"""
from __future__ import annotations

from .common import SCRATCH_WORDS, SIM  # noqa: F401 - re-exported for the kernels

if SIM:
    from ._intrinsics_sim import *  # noqa: F401,F403
else:  # pragma: no cover - GPU only
    from ._intrinsics_ptx import *  # noqa: F401,F403
