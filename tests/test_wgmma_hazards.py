"""The SASS check of ``scripts/checks/ptxas_wgmma.py``: an instruction that writes an in-flight ``wgmma``'s A
registers before the ``WARPGROUP.DEPBAR`` that retires it is found, across the step loop's backward branch, and a
``DEPBAR.LE gsb0, 0x1`` retires every group but the newest.
The pattern is the one ptxas produced for a spmm_ws variant that decoded the next step before retiring the
previous one, which gave wrong results on an H100 (docs/kernels-notes.md "v20")."""
from __future__ import annotations

from scripts.checks.ptxas_wgmma import a_register_hazards

_LOOP = """\
.L_x_29:
        /*1cf0*/                   {wait}
        /*1d00*/                   LDS.64 R16, [R3] ;
        /*1d10*/                   POPC {w1}, R16 ;
        /*1d20*/                   PRMT {w2}, R70, R17, 0x54101022 ;
        /*1d30*/                   WARPGROUP.ARRIVE ;
        /*1d40*/                   HGMMA.64x64x16.F32 R24, R56, gdesc[UR4], R24 ;
        /*1d50*/                   HGMMA.64x64x16.F32 R24, R60, gdesc[UR4], R24, gsb0 ;
        /*1d60*/                   IADD3 R8, R8, 0x1, RZ ;
        /*1d70*/               @P1 BRA `(.L_x_29) ;
        /*1d80*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""


def _sass(w1="R20", w2="R21", wait="NOP ;"):
    return _LOOP.format(w1=w1, w2=w2, wait=wait)


def test_a_write_to_an_in_flight_a_register_is_found_across_the_loop():
    found = a_register_hazards(_sass(w1="R57", w2="R62"))     # R57: the first product's A, R62: the second's
    assert {t for _, t in found} == {"POPC R57, R16", "PRMT R62, R70, R17, 0x54101022"}


def test_writes_after_the_wait_or_to_other_registers_are_fine():
    assert a_register_hazards(_sass()) == []
    assert a_register_hazards(_sass(w1="R57", w2="R62", wait="WARPGROUP.DEPBAR.LE gsb0, 0x0 ;")) == []


_TURNS = """\
.L_x_7:
        /*2340*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*2350*/                   LDS.128 {a0}, [R13] ;
        /*2360*/                   WARPGROUP.ARRIVE ;
        /*2370*/                   HGMMA.SP.64x128x32.F32 R24, R164, gdesc[UR4], R24, R168, 0x0, gsb0 ;
        /*2380*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*2390*/                   LDS.128 {a1}, [R14] ;
        /*23a0*/                   WARPGROUP.ARRIVE ;
        /*23b0*/                   HGMMA.SP.64x128x32.F32 R88, R152, gdesc[UR4], R88, R170, 0x0, gsb0 ;
        /*23c0*/                   IADD3 R8, R8, 0x1, RZ ;
        /*23d0*/               @P1 BRA `(.L_x_7) ;
        /*23e0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""


def test_a_wait_that_keeps_the_newest_group_running_retires_only_the_older_ones():
    """Two tile rows taking turns (sp24_ws's pipelined build): ``DEPBAR.LE gsb0, 0x1`` retires every group but the
    newest, so loading the other row's operands into the registers of the group still running is a hazard, and
    loading them into their own is not."""
    assert a_register_hazards(_TURNS.format(a0="R164", a1="R152")) == []
    found = a_register_hazards(_TURNS.format(a0="R164", a1="R166"))   # row 1 loads into row 0's running registers
    assert {t for _, t in found} == {"LDS.128 R166, [R14]"}
    found = a_register_hazards(_TURNS.format(a0="R152", a1="R152"))   # row 0 loads into row 1's, across the loop
    assert {t for _, t in found} == {"LDS.128 R152, [R13]"}           # (row 1's own load comes after its wait)
