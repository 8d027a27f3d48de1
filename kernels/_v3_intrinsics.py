"""The inline-PTX pieces that spmm_v3 adds to spmm_warp's, in two forms chosen by ``SIM``.

- ``ldsm_x4``: one ``ldmatrix.sync.aligned.m8n8.x4.shared.b16``: each lane gives the shared byte
  address of one 16-byte row (lanes 8m..8m+7: the rows of matrix m) and gets, of each of the four
  8x8 matrices, word ``lane % 4`` of row ``lane / 4``: the B fragments of two TCTiles for one
  8-token block when the rows are tokens and the matrices 8-column steps along K.
- ``make_x_issue``: the predicated 16-byte ``cp.async`` copies of a warp's share of the block's X
  slice (no commit: the ``step_issue`` that follows commits them with the step's values and bitmaps).

GPU: ``_v3_intrinsics_ptx``; simulator: ``_v3_intrinsics_sim`` (same names and signatures).
"""
from __future__ import annotations

from .common import SIM

if SIM:
    from ._v3_intrinsics_sim import *  # noqa: F401,F403
else:  # pragma: no cover - GPU only
    from ._v3_intrinsics_ptx import *  # noqa: F401,F403
