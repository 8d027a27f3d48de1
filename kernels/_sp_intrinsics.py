"""The device primitives of the 2:4 kernel (sp24_kernel), in two forms chosen by ``SIM``.

- ``mma_sp``: one ``mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32`` with
  sparsity selector 0 (the operand, fragment and metadata layouts of /work/shared/notes/mma-sp-facts.md,
  docs/kernels-notes.md "v13-sp");
- ``mma_k32``: the k = 32 step of one 16x8 output block: ``mma_sp`` for a 2:4 tile, two
  ``mma.sync.m16n8k16`` for a dense one (the same B registers serve both);
- ``ldmatrix_x4``: ``ldmatrix.sync.aligned.m8n8.x4.shared.b16`` (the B fragments of 32 columns
  of 8 staged token rows);
- ``ldg128`` / ``stg128`` / ``sts128``: 16-byte global loads (``ld.global.nc.v4.u32``), global stores and shared stores;
- ``cp16`` / ``cp_commit``: one 16-byte ``cp.async.cg`` global-to-shared copy (a source size of 0
  writes zeros) and the end of a copy group (waited for with ``cp_wait*``: 0-2 in ``_intrinsics``,
  ``cp_wait3`` .. ``cp_wait6`` here, for rings of up to 8 stages).

GPU: ``_sp_intrinsics_ptx``; simulator: ``_sp_intrinsics_sim`` (same names and signatures).
"""
from __future__ import annotations

from .common import SIM

if SIM:
    from ._sp_intrinsics_sim import *  # noqa: F401,F403
else:  # pragma: no cover - GPU only
    from ._sp_intrinsics_ptx import *  # noqa: F401,F403
