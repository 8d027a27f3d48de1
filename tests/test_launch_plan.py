"""spmm_warp's launch plan (kernels/launch.py): the invariants every plan keeps, and the sweep's choices."""
import pytest

from sparsekit.kernels import launch, spmm_warp

SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (11008, 4096), (4096, 11008),
          (14336, 4096), (22016, 4096), (2048, 32768), (64, 64), (8192, 8192)]


def gk_of(k: int) -> int:
    return -(-k // 64)


@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("n", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("dense", [False, True])
def test_plan_fits(m, k, n, dense):
    """Whatever the launcher runs fits: shared memory, registers, steps per warp."""
    gk = gk_of(k)
    # the stage capacity: a 50% weight's, or the widest (a weight first seen inside graph capture)
    d = spmm_warp.DENSE_CHUNKS
    vchs = (d, 2 * d, 0, 4 * d) if dense else (70, 140, 0, 280)
    c = launch.warp_chunk(m, gk, n, vchs)
    assert 0 < c <= n
    r = launch.warp_strips(m, gk, c)
    warps, stages, smem = launch.warp_plan(m, gk, c, vchs[r - 1], r=r)
    # every GroupTile column gets a warp-step: at most 32 steps per warp (one offsets register per lane)
    assert warps * spmm_warp.MAX_STEPS >= gk
    assert 1 <= warps <= min(gk, spmm_warp.MAX_WARPS)
    # the block's registers fit the register file (16 warps above 64 registers: the H100 launch limit seen)
    assert warps <= (32 if spmm_warp.max_registers(c, r) <= 64 else 16)
    assert 2 <= stages <= 4
    assert smem == spmm_warp.smem_bytes(warps, vchs[r - 1], c, stages, r) <= launch.WARP_SMEM_MAX
    if c < n:   # a smaller chunk only where the whole one did not fit
        r2 = launch.warp_strips(m, gk, n)
        assert launch.warp_plan(m, gk, n, vchs[r2 - 1], r=r2)[2] > launch.WARP_SMEM_MAX


def test_long_k_many_tokens_get_smaller_chunks():
    """K = 32768 needs 16 warps; with 64 tokens their stages cannot fit, so the launcher takes fewer
    tokens per launch instead of failing to launch (seen missing in review: the plan overflowed)."""
    d = spmm_warp.DENSE_CHUNKS
    assert launch.warp_chunk(2048, 512, 64, (70, 140, 0, 280)) < 64
    assert launch.warp_chunk(4096, 172, 64, (70, 140, 0, 280)) == 64
    assert launch.warp_chunk(4096, 172, 64, (d, 2 * d, 0, 4 * d)) < 64


def test_tall_weights_take_short_blocks():
    """From the H100 sweep (scripts/tune_kernels.py): tall weights with K < 8192 run 4 warps of 16
    steps with two strips per step; 6 warps and 3 stages below 8 tokens once blocks exceed 4 per SM."""
    vch = 2 * 70
    assert launch.warp_strips(11008, 64, 1) == 2
    assert launch.warp_plan(11008, 64, 1, vch, r=2, sms=132)[:2] == (4, 2)
    assert launch.warp_plan(11008, 64, 16, vch, r=2, sms=132)[:2] == (4, 2)
    assert launch.warp_plan(22016, 64, 1, vch, r=2, sms=132)[:2] == (6, 3)
    assert launch.warp_plan(22016, 64, 16, vch, r=2, sms=132)[:2] == (4, 2)
    # a square 4096 weight has too few blocks for short ones; long K keeps 16 warps
    assert launch.warp_plan(4096, 64, 1, vch, r=2, sms=132)[:2] == (8, 2)
    assert launch.warp_plan(4096, 172, 1, vch, r=2, sms=132)[:2] == (16, 2)
    # on a GPU with fewer SMs the same weight counts as tall sooner
    assert launch.warp_plan(4096, 64, 1, vch, r=2, sms=64)[:2] == (4, 2)
    # small M keeps one strip per step
    assert launch.warp_strips(576, 9, 1) == 1


def test_very_tall_weights_take_whole_grouptile_rows():
    """From the H100 probe (scripts/probe_kernels.py, v9): four strips per step (a block per
    GroupTile row, 4 warps) where that still leaves 1.5 blocks per SM, up to 16 tokens."""
    assert launch.warp_strips(22016, 64, 1) == 4
    assert launch.warp_strips(14336, 64, 16) == 4
    assert launch.warp_plan(14336, 64, 16, 280, r=4, sms=132)[:2] == (4, 2)
    assert launch.warp_strips(14336, 64, 32) == 2       # 32 tokens: two strips
    assert launch.warp_strips(11008, 64, 1) == 2        # 172 blocks: too few for 132 SMs
    assert launch.warp_strips(12288, 64, 1) == 2
    assert launch.warp_strips(22016, 64, 1, sms=264) == 2
    assert launch.warp_strips(14336, 172, 1) == 2       # long K keeps two
