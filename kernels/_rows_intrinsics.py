"""The inline-PTX piece that spmm_rows adds to spmm_warp's, in two forms chosen by ``SIM``.

- ``make_x_issue``: the predicated 16-byte ``cp.async`` copies of a thread's share of the block's X
  slice (no commit: the ``step_issue`` that follows commits them with the step's values and bitmaps).

GPU: ``_rows_intrinsics_ptx``; simulator: ``_rows_intrinsics_sim`` (same names and signatures).
"""
from __future__ import annotations

from .common import SIM

if SIM:
    from ._rows_intrinsics_sim import *  # noqa: F401,F403
else:  # pragma: no cover - GPU only
    from ._rows_intrinsics_ptx import *  # noqa: F401,F403
