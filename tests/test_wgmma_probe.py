"""Host side of the wgmma.sp probe (scripts/checks/gpu_wgmma.py; the instruction itself runs on the GPU
only): the descriptor's bit fields, where the B image puts each value, and that the probe's first
metadata candidate is mma.sp's verified per-warp arrangement for every warp of the warpgroup."""
from __future__ import annotations

import torch

from scripts.checks import gpu_wgmma


def test_descriptor_bit_fields():
    from sparsekit.kernels.wgmma import descriptor

    d = descriptor(128, 256, swizzle=1, base=3)
    assert d & 0x3FFF == 0                                  # start address: added by the kernel
    assert (d >> 16) & 0x3FFF == 128 >> 4 and (d >> 32) & 0x3FFF == 256 >> 4
    assert (d >> 49) & 7 == 3 and d >> 62 == 1
    assert descriptor(16, 16) == (1 << 16) | (1 << 32)


def test_b_image_places_core_matrices():
    b = torch.arange(512, dtype=torch.float32).reshape(32, 16).half()
    for kstep, nstep in ((128, 512), (256, 128)):
        img = gpu_wgmma.b_image(b, kstep, nstep).view(torch.float16)
        for k, n in ((0, 0), (7, 3), (8, 0), (31, 7), (0, 8), (17, 15)):
            assert img[((k // 8) * kstep + (n // 8) * nstep + (n % 8) * 16 + (k % 8) * 2) // 2] == b[k, n]
        assert sorted(img.float().tolist())[-512:] == sorted(b.float().reshape(-1).tolist())  # each value once


def test_candidates_never_overlap_core_matrices_and_try_both_roles():
    for n in (8, 16):
        cands = list(gpu_wgmma.candidates(n))
        assert cands and all(gpu_wgmma._disjoint(k, ns, n) for _, k, ns, _, _ in cands)
    cands = list(gpu_wgmma.candidates(16))
    assert {(lbo, sbo) for _, k, ns, lbo, sbo in cands if (k, ns) == (128, 512)} == {(128, 512), (512, 128)}
    assert not gpu_wgmma._disjoint(128, 256, 16)          # the second N block would land on K block 2


def test_first_metadata_candidate_is_mma_sp_per_warp():
    """Warp w of the warpgroup gets, for its rows 16w .., exactly the words sp24_probe builds for mma.sp."""
    a, comp, idx, b, c = gpu_wgmma.operands(0)
    meta = gpu_wgmma.meta_regs(idx, "mma.sp")
    regs = gpu_wgmma.a_regs(comp)
    for w in range(4):
        for ln in range(32):
            t, g = ln & 3, ln >> 2
            if t < 2:
                word = 0
                for rh in range(2):
                    for jj in range(4):
                        i0, i1 = idx[16 * w + g + 8 * rh, 4 * t + jj].tolist()
                        word |= (i0 | i1 << 2) << (16 * rh + 4 * jj)
                assert meta[32 * w + ln].item() & 0xFFFFFFFF == word
    # A and D round trip: the D layout read back from C's registers is C itself (N = 8 and 16)
    assert torch.equal(gpu_wgmma.d_matrix(gpu_wgmma.c_regs(c)), c.double())
    c16 = gpu_wgmma.operands(1, 16)[4]
    assert c16.shape == (64, 16) and torch.equal(gpu_wgmma.d_matrix(gpu_wgmma.c_regs(c16)), c16.double())
    # the A registers hold every compressed value once
    vals = regs.view(torch.int16).view(torch.float16).reshape(-1)
    assert sorted(vals.float().tolist()) == sorted(comp.float().reshape(-1).tolist())
