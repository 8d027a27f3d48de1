"""The warpgroup kernel's device primitives (sp24_wg), in two forms chosen by ``SIM``: inline PTX for
sm_90a (``_wg_intrinsics_ptx``) and a Python twin of the same contract (``_wg_intrinsics_sim``)."""
from __future__ import annotations

from .common import SIM

if SIM:
    from ._wg_intrinsics_sim import *  # noqa: F401,F403
else:  # pragma: no cover - GPU only
    from ._wg_intrinsics_ptx import *  # noqa: F401,F403
