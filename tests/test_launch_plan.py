"""spmm_warp's launch plan (kernels/plan.py): the invariants every plan keeps, and the sweep's choices."""
import subprocess
import sys

import pytest
import torch

from sparsekit.kernels import plan

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
    d = plan.DENSE_CHUNKS
    vchs = (d, 2 * d, 0, 4 * d) if dense else (70, 140, 0, 280)
    c = plan.warp_chunk(m, gk, n, vchs)
    assert 0 < c <= n
    r = plan.warp_strips(m, gk, c)
    warps, stages, smem = plan.warp_plan(m, gk, c, vchs[r - 1], r=r)
    # every GroupTile column gets a warp-step: at most 32 steps per warp (one offsets register per lane)
    assert warps * plan.MAX_STEPS >= gk
    assert 1 <= warps <= min(gk, plan.MAX_WARPS)
    # the block's registers fit the register file (16 warps above 64 registers: the H100 launch limit seen)
    assert warps <= (32 if plan.warp_max_registers(c, r) <= 64 else 16)
    assert 2 <= stages <= 4
    assert smem == plan.warp_smem_bytes(warps, vchs[r - 1], c, stages, r) <= plan.WARP_SMEM_MAX
    if c < n:   # a smaller chunk only where the whole one did not fit
        r2 = plan.warp_strips(m, gk, n)
        assert plan.warp_plan(m, gk, n, vchs[r2 - 1], r=r2)[2] > plan.WARP_SMEM_MAX


def test_long_k_many_tokens_get_smaller_chunks():
    """K = 32768 needs 16 warps; with 64 tokens their stages cannot fit, so the launcher takes fewer
    tokens per launch instead of failing to launch (seen missing in review: the plan overflowed)."""
    d = plan.DENSE_CHUNKS
    assert plan.warp_chunk(2048, 512, 64, (70, 140, 0, 280)) < 64
    assert plan.warp_chunk(4096, 172, 64, (70, 140, 0, 280)) == 64
    assert plan.warp_chunk(4096, 172, 64, (d, 2 * d, 0, 4 * d)) < 64


def test_tall_weights_take_short_blocks():
    """From the H100 sweep (scripts/tune_kernels.py): tall weights with K < 8192 run 4 warps of 16
    steps with two strips per step; 6 warps and 3 stages below 8 tokens once blocks exceed 4 per SM."""
    vch = 2 * 70
    assert plan.warp_strips(11008, 64, 1) == 2
    assert plan.warp_plan(11008, 64, 1, vch, r=2, sms=132)[:2] == (4, 2)
    assert plan.warp_plan(11008, 64, 16, vch, r=2, sms=132)[:2] == (4, 2)
    assert plan.warp_plan(22016, 64, 1, vch, r=2, sms=132)[:2] == (6, 3)
    assert plan.warp_plan(22016, 64, 16, vch, r=2, sms=132)[:2] == (4, 2)
    # a square 4096 weight has too few blocks for short ones; long K keeps 16 warps
    assert plan.warp_plan(4096, 64, 1, vch, r=2, sms=132)[:2] == (8, 2)
    assert plan.warp_plan(4096, 172, 1, vch, r=2, sms=132)[:2] == (16, 2)
    # on a GPU with fewer SMs the same weight counts as tall sooner
    assert plan.warp_plan(4096, 64, 1, vch, r=2, sms=64)[:2] == (4, 2)
    # small M keeps one strip per step
    assert plan.warp_strips(576, 9, 1) == 1


def test_very_tall_weights_take_whole_grouptile_rows():
    """From the H100 probe (scripts/probe_kernels.py, v9): four strips per step (a block per
    GroupTile row, 4 warps) where that still leaves 1.5 blocks per SM, up to 16 tokens."""
    assert plan.warp_strips(22016, 64, 1) == 4
    assert plan.warp_strips(14336, 64, 16) == 4
    assert plan.warp_plan(14336, 64, 16, 280, r=4, sms=132)[:2] == (4, 2)
    assert plan.warp_strips(14336, 64, 32) == 2       # 32 tokens: two strips
    assert plan.warp_strips(11008, 64, 1) == 2        # 172 blocks: too few for 132 SMs
    assert plan.warp_strips(12288, 64, 1) == 2
    assert plan.warp_strips(22016, 64, 1, sms=264) == 2
    assert plan.warp_strips(14336, 172, 1) == 2       # long K keeps two


def test_plan_is_pure():
    """plan.py imports no numba: the planner runs (and is tested) without the CUDA target."""
    code = "import sys; import sparsekit.kernels.plan; print(any(m.split('.')[0] == 'numba' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_split_plan_and_variants():
    assert plan.split_plan(1, 4, None) == (2, 2)           # ~TARGET_BLOCKS, at least 2 steps per block
    assert plan.split_plan(64, 300, 1) == (3, 100)          # at most KPER_MAX GroupTiles per block
    assert plan.split_plan(1, 3, 64) == (3, 1)              # at most one split per GroupTile
    assert plan.variant(1) == (1, False) and plan.variant(2) == (8, True) and plan.variant(17) == (32, True)
    assert plan.cuda_core_max(9, 9) == plan.CUDA_CORE_MAX_N and plan.cuda_core_max(4096, 64) == 0
    assert plan.cuda_core_max(4096, 64, 8) == 8
    assert plan.spmm_stages(10) == 4 and plan.spmm_stages(2000) == 2


def test_strip_chunks_and_vcap():
    """Stage capacities read from the packed weight's offsets (dense counts inside graph capture)."""
    from sparsekit.packed.tcabme import encode

    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 128, generator=g).half()
    p = encode(w)                                          # dense: 1024 values per strip
    assert plan.strip_chunks(p, 1) == 128 and plan.strip_chunks(p, 2) == 256 and plan.strip_chunks(p, 4) == 512
    assert plan.vcap(p) == plan.VCAP_DENSE
    w[torch.rand(128, 128, generator=g) < 0.75] = 0
    p = encode(w)
    assert 1 <= plan.strip_chunks(p, 1) < 128 and plan.vcap(p) < plan.VCAP_DENSE
    assert plan.strip_chunks(p, 2, capturing=True) == 2 * plan.DENSE_CHUNKS
    assert plan.vcap(p, capturing=True) == plan.VCAP_DENSE


@pytest.mark.parametrize("m", [16, 100, 4096, 22016])
@pytest.mark.parametrize("gk", [1, 3, 64, 448])
@pytest.mark.parametrize("n", [1, 8, 9, 16, 17, 32, 33, 512])
def test_sp24_plan_invariants(m, gk, n):
    """The 2:4 kernel's plan: a compiled variant (8/16/32 tokens; the spill-free strip counts), every
    output row and token covered, warps within the K tiles, shared memory within its limit."""
    from sparsekit.kernels import sp24_plan

    nt, r, nw, rb, chunks, dyn = sp24_plan.plan(m, gk, n)
    assert nt in (8, 16, 32) and nt >= min(n, 32) and chunks * nt >= n > (chunks - 1) * nt
    assert r <= {8: 4, 16: 2, 32: 1}[nt] and rb * r * 16 >= m > (rb - 1) * r * 16
    assert 1 <= nw <= min(gk, sp24_plan.MAX_WARPS) and dyn == sp24_plan.smem_bytes(nw, nt, r) <= sp24_plan.SMEM_MAX
