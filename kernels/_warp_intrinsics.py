"""The inline-PTX pieces of spmm_warp, in two forms chosen by ``SIM``: GPU and simulator.

- ``make_step_issue``: every predicated 16-byte ``cp.async`` of one pipeline step (the strip's
  value chunks, one bitmap chunk, the X chunks), then ``cp.async.commit_group``. Lane offsets are
  immediates; a chunk is copied when its remaining count is positive.
- ``scan_counts``: the exclusive warp prefix sum of a per-lane count (five ``shfl.sync.up`` with
  the predicate output doing the "lane >= d" test).
- ``decode_at``: SMBD decode of one A-fragment register from a table entry holding the half-bitmap
  word and the shared-memory byte address of its first value:
  ``and; popc; mad`` (address), two ``ld.shared.u16``, ``shr; and; mad; prmt`` (the 2-bit code
  picks a byte permutation), ``prmt``.
- ``byte_addr``, ``lds32b``, ``lds128b``, ``sts64b``: shared-memory byte addresses and accesses.

GPU: ``_warp_intrinsics_ptx``; simulator: ``_warp_intrinsics_sim`` (same names and signatures).
"""
from __future__ import annotations

from .common import SIM

if SIM:
    from ._warp_intrinsics_sim import *  # noqa: F401,F403
else:  # pragma: no cover - GPU only
    from ._warp_intrinsics_ptx import *  # noqa: F401,F403
