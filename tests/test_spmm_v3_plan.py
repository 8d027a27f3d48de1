"""spmm_v3's launch plan (kernels/plan.py, pure): every plan for the issue-21 shapes and 1-128
tokens launches (shared memory, warps, steps per warp) and covers every token."""
from __future__ import annotations

import pytest

from sparsekit.kernels import plan

SHAPES = [(4096, 4096), (22016, 4096), (4096, 11008), (28672, 8192), (8192, 28672), (100, 72)]


@pytest.mark.parametrize("m,k", SHAPES)
def test_v3_plans_fit_and_cover(m, k):
    gk = -(-k // 64)
    for vch in (65, plan.DENSE_CHUNKS):          # 50% strips, and the dense capacity (graph capture)
        for n in (1, 5, 8, 13, 16, 32, 33, 64, 100, 128):
            nb, wr, ks, st, ny, dyn = plan.v3_plan(m, gk, n, vch)
            assert dyn <= plan.WARP_SMEM_MAX and dyn == plan.v3_smem_bytes(wr, ks, 8 * nb, vch, st)
            assert wr in (1, 2, 4, 8) and wr * ks <= plan.V3_MAX_WARPS and ks <= gk
            assert 8 * nb * ny >= n > 8 * nb * (ny - 1)             # every token, no empty chunk
            assert 32 * wr * ks * plan.v3_max_registers(nb) <= 65536   # the block's registers fit an SM
            assert plan.v3_blocks(m, wr) * wr * 16 >= m


def test_v3_plan_shares_x_and_keeps_tokens_together():
    # tall weights: 8 strip rows share each X slice; up to V3_MAX_NT tokens need one decode
    nb, wr, ks, st, ny, _ = plan.v3_plan(22016, 64, 64, 65)
    assert (wr, ny, nb) == (8, 1, 8)
    # long K shares X too (a warp's steps are not limited to 32): 4 strip rows, 64 tokens, one chunk
    nb, wr, ks, st, ny, dyn = plan.v3_plan(8192, 448, 64, 65)
    assert (wr, 8 * nb, ny) == (4, 64, 1) and dyn <= plan.WARP_SMEM_MAX
    # a plan that cannot fit shrinks the token chunk before giving up stages or K groups
    nb, wr, ks, st, ny, dyn = plan.v3_plan(4096, 64, 64, plan.DENSE_CHUNKS, wr=2, ks=8, stages=3)
    assert dyn <= plan.WARP_SMEM_MAX and (ks, st) == (8, 3) and 8 * nb < 64


def test_kernel_choice_is_opt_in(monkeypatch, capsys):
    from sparsekit.errors import SparsekitError
    from sparsekit.kernels import matmul

    matmul.reset_kernel_choice()
    monkeypatch.delenv("SPARSEKIT_KERNEL", raising=False)
    assert matmul.kernel_choice() == "default" and capsys.readouterr().err == ""
    matmul.reset_kernel_choice()
    monkeypatch.setenv("SPARSEKIT_KERNEL", "v3")
    assert matmul.kernel_choice() == "v3"
    assert matmul.kernel_choice() == "v3"
    assert capsys.readouterr().err.count("SPARSEKIT_KERNEL=v3") == 1     # said once
    matmul.reset_kernel_choice()
    monkeypatch.setenv("SPARSEKIT_KERNEL", "v4")
    with pytest.raises(SparsekitError, match="SPARSEKIT_KERNEL"):
        matmul.kernel_choice()
    matmul.reset_kernel_choice()


@pytest.mark.parametrize("m,k", SHAPES)
def test_v3_forced_plans_are_cut_to_what_launches(m, k):
    gk = -(-k // 64)
    for knobs in (dict(wr=8), dict(wr=8, ks=4), dict(wr=1, ks=32), dict(nt=128), dict(wr=4, stages=4)):
        for n in (1, 64, 128):
            nb, wr, ks, st, ny, dyn = plan.v3_plan(m, gk, n, plan.DENSE_CHUNKS, **knobs)
            assert 32 * wr * ks * plan.v3_max_registers(nb) <= 65536 and wr * ks <= plan.MAX_WARPS
            assert dyn <= plan.WARP_SMEM_MAX, (knobs, n)
