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


# The plans the H100 sweeps measured fastest (scripts/bench/tune_kernels.py, scripts/bench/probe_kernels.py; the
# tables are in docs/kernels-notes.md v7-v9 and docs/benchmarks.md). These numbers are measurements,
# not the planner's past output: the planner must keep choosing them (132 SMs unless said).
# (m, gk, tokens, sms) -> (strips per warp-step, warps, stages)
SWEEP_CHOICES = {
    (11008, 64, 1, 132): (2, 4, 2),     # v7: tall, K < 8192: 2 strips x 4 warps x 16 steps (31.0 -> 27.8 us)
    (11008, 64, 16, 132): (2, 4, 2),    # v7 (40.7 -> 33.3 us)
    (22016, 64, 16, 132): (4, 4, 2),    # v9: 1.5+ blocks per SM with whole GroupTile rows (58.3 -> 52.3 us)
    (22016, 64, 1, 132): (4, 4, 2),     # v9 (49.2 -> 44.6 us)
    (14336, 64, 16, 132): (4, 4, 2),    # v9 (40.0 -> 36.8 us)
    (14336, 64, 32, 132): (2, 4, 2),    # v9: from 32 tokens two strips again
    (22016, 64, 1, 264): (2, 4, 2),     # twice the SMs: too few blocks for whole rows, 2.6 per SM
    (4096, 64, 1, 132): (2, 8, 2),      # v7: a square weight has too few blocks for short ones
    (4096, 172, 1, 132): (2, 16, 2),    # long K keeps 16 warps
    (4096, 64, 1, 64): (2, 4, 2),       # fewer SMs: the same weight counts as tall sooner
    (14336, 172, 1, 132): (2, 16, 2),   # long K keeps two strips
    (576, 9, 1, 132): (1, 9, 2),        # small M keeps one strip; short K one step per warp
}


@pytest.mark.parametrize("key", SWEEP_CHOICES)
def test_the_plans_the_sweeps_measured_fastest(key):
    m, gk, n, sms = key
    r = plan.warp_strips(m, gk, n, sms=sms)
    assert (r, *plan.warp_plan(m, gk, n, 70 * r, r=r, sms=sms)[:2]) == SWEEP_CHOICES[key]


def test_two_strips_on_a_crowded_tall_weight_below_8_tokens():
    """v7: with two strips per step, more than 4 blocks per SM below 8 tokens took 6 warps and 3 stages."""
    assert plan.warp_plan(22016, 64, 1, 140, r=2, sms=132)[:2] == (6, 3)
    assert plan.warp_plan(22016, 64, 8, 140, r=2, sms=132)[:2] == (4, 2)


def test_plan_is_pure():
    """plan.py imports no numba: the planner runs (and is tested) without the CUDA target."""
    code = "import sys; import sparsekit.kernels.plan; print(any(m.split('.')[0] == 'numba' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("gm", [1, 9, 64, 172, 528, 1000])
@pytest.mark.parametrize("gk", [1, 2, 3, 9, 64, 172, 300, 512])
@pytest.mark.parametrize("splits", [None, 1, 2, 3, 7, 64, 10_000])
def test_split_plan_invariants(gm, gk, splits):
    """Every GroupTile column in exactly one split, none empty, at most KPER_MAX per block; an asked
    split count is kept where it can be; the default aims at TARGET_BLOCKS blocks of 2+ steps."""
    nsplit, kper = plan.split_plan(gm, gk, splits)
    assert 1 <= nsplit <= gk and 1 <= kper <= plan.KPER_MAX
    assert (nsplit - 1) * kper < gk <= nsplit * kper
    if splits is not None and -(-gk // plan.KPER_MAX) <= splits <= gk:
        assert nsplit <= splits and -(-gk // nsplit) == -(-gk // splits)   # the same GroupTiles per split
    if splits is None:
        assert kper >= min(2, gk)
        assert gm * nsplit <= max(plan.TARGET_BLOCKS + gm, gm * -(-gk // plan.KPER_MAX))


@pytest.mark.parametrize("n", range(1, 70))
def test_variant_invariants(n):
    """Enough token slots; tensor cores above the CUDA-core limit, in the smallest power-of-two slots from 8."""
    slots, tensor_cores = plan.variant(n)
    assert slots >= n and tensor_cores == (n > plan.CUDA_CORE_MAX_N)
    if tensor_cores:
        assert slots >= 8 and slots & (slots - 1) == 0 and (slots == 8 or slots // 2 < n)


def test_cuda_core_and_stage_rules():
    for m, gk in ((9, 9), (4096, 64), (64, 1)):
        small = m * gk * 64 <= plan.CUDA_CORE_MAX_WEIGHTS
        assert plan.cuda_core_max(m, gk) == (plan.CUDA_CORE_MAX_N if small else 0)
        assert plan.cuda_core_max(m, gk, 8) == 8   # an override is taken as it is
    for slot in (1, 10, 500, 2000, 10_000):
        s = plan.spmm_stages(slot)
        assert s in (2, 3, 4) and (s == 2 or s * slot * 8 <= plan.DYN_SMEM_MAX)
        assert s == 4 or (s + 1) * slot * 8 > plan.DYN_SMEM_MAX   # as many as fit


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
