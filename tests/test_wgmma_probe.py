"""Host side of the wgmma.sp probe (scripts/checks/gpu_wgmma.py; the instruction itself runs on the GPU
only): the descriptor's bit fields, where the B image puts each value, and that the probe's first
metadata candidate is mma.sp's verified per-warp arrangement for every warp of the warpgroup."""
from __future__ import annotations

import torch

from scripts.checks import gpu_wgmma


def test_descriptor_bit_fields():
    from sparsekit.kernels.wgmma_probe import descriptor

    d = descriptor(128, 256, swizzle=1, base=3)
    assert d & 0x3FFF == 0                                  # start address: added by the kernel
    assert (d >> 16) & 0x3FFF == 128 >> 4 and (d >> 32) & 0x3FFF == 256 >> 4
    assert (d >> 49) & 7 == 3 and d >> 62 == 1
    assert descriptor(16, 16) == (1 << 16) | (1 << 32)


def test_b_image_places_core_matrices():
    b = torch.arange(256, dtype=torch.float32).reshape(32, 8).half()
    for kstep in (128, 256):
        img = gpu_wgmma.b_image(b, kstep).view(torch.float16)
        for k, n in ((0, 0), (7, 3), (8, 0), (31, 7)):
            assert img[((k // 8) * kstep + n * 16 + (k % 8) * 2) // 2] == b[k, n]


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
    # A and D round trip: the D layout read back from C's registers is C itself
    assert torch.equal(gpu_wgmma.d_matrix(gpu_wgmma.c_regs(c)), c.double())
    # the A registers hold every compressed value once
    vals = regs.view(torch.int16).view(torch.float16).reshape(-1)
    assert sorted(vals.float().tolist()) == sorted(comp.float().reshape(-1).tolist())
