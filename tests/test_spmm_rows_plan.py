"""Launch planning of spmm_rows (pure functions of shapes, no GPU): token chunks, the split rule, the
ring depth within shared memory, one clear error for a forced plan that cannot run, and the opt-in."""
from __future__ import annotations

import pytest

from sparsekit.kernels import plan
from sparsekit.kernels.spmm_rows import smem_bytes

SHAPES = [(4096, 4096), (22016, 4096), (4096, 11008), (8192, 28672), (100, 72), (64, 64)]


@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 17, 33, 64, 65, 128, 4096])
def test_every_plan_covers_n_fits_shared_memory_and_splits_k_without_empty_splits(m, k, n):
    gk = -(-k // 64)
    nt, st, _r, rb, chunks, ks, kper, _blocks, dyn = plan.rows_plan(m, gk, n, sms=132)
    assert nt in (8, 16, 32, 64) and (nt >= n or nt == 64) and (nt == 8 or nt // 2 < n)
    assert (chunks - 1) * nt < n <= chunks * nt
    assert rb * 64 >= m > (rb - 1) * 64
    assert (ks - 1) * kper < gk <= ks * kper                 # every split has a column
    assert 2 <= st <= plan.ROWS_MAX_STAGES
    assert dyn == smem_bytes(nt, st) <= plan.ROWS_SMEM_MAX
    assert dyn >= nt * 64 * 4                                # the fp32 output tile fits at the end
    assert ks == 1 or (rb * chunks * ks <= plan.ROWS_MAX_BLOCKS_PER_SM * 132 and gk // ks >= plan.ROWS_MIN_STEPS)


@pytest.mark.parametrize("m,k,n,splits", [
    (4096, 4096, 1, 4), (22016, 4096, 1, 1), (4096, 11008, 1, 8), (8192, 28672, 1, 4), (8192, 28672, 128, 2),
    (22016, 4096, 128, 1), (100, 72, 1, 1),
])
def test_splits_give_two_to_four_blocks_per_sm_where_k_allows(m, k, n, splits):
    assert plan.rows_plan(m, -(-k // 64), n, sms=132).ks == splits


def test_ring_depth_per_token_chunk():
    """4 stages up to 16 tokens, 3 at 32, 2 at 64: each the deepest that fits ROWS_SMEM_MAX."""
    assert [plan.rows_stages(nt) for nt in (8, 16, 32, 64)] == [4, 4, 3, 2]
    for nt in (8, 16, 32, 64):
        st = plan.rows_stages(nt)
        assert smem_bytes(nt, st) <= plan.ROWS_SMEM_MAX
        assert st == plan.ROWS_MAX_STAGES or smem_bytes(nt, st + 1) > plan.ROWS_SMEM_MAX


def test_forced_plans():
    p = plan.rows_plan(4096, 64, 100, tokens=8)
    assert (p.nt, p.stages, p.rb, p.chunks) == (8, 4, 64, 13)
    assert plan.rows_plan(4096, 5, 1, splits=3)[5:7] == (3, 2)           # 2 + 2 + 1 columns
    assert plan.rows_plan(4096, 5, 1, splits=9)[5:7] == (5, 1)           # at most one split per column
    assert plan.rows_plan(4096, 64, 1, tokens=32, stages=2)[:2] == (32, 2)
    with pytest.raises(ValueError, match="shared memory"):
        plan.rows_plan(4096, 64, 8, stages=5)                             # 50704 B: dense strip slots
    with pytest.raises(ValueError, match="shared memory"):
        plan.rows_plan(4096, 64, 64, stages=3)
    with pytest.raises(ValueError, match="tokens"):
        plan.rows_plan(4096, 64, 8, tokens=12)
    with pytest.raises(ValueError, match="stages"):
        plan.rows_plan(4096, 64, 8, stages=1)


def test_rows_is_opt_in(monkeypatch, capsys):
    from sparsekit.kernels import matmul

    matmul.reset_kernel_choice()
    monkeypatch.delenv("SPARSEKIT_KERNEL", raising=False)
    assert matmul.kernel_choice() == "default"
    matmul.reset_kernel_choice()
    monkeypatch.setenv("SPARSEKIT_KERNEL", "rows")
    assert matmul.kernel_choice() == "rows"
    assert capsys.readouterr().err.count("SPARSEKIT_KERNEL=rows") == 1
    matmul.reset_kernel_choice()
