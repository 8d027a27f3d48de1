"""Launch planning of sp24_rows (pure functions, no GPU): the split rule measured on an H200, the
shared-memory budget, and the kernel the ``auto`` choice takes."""
from __future__ import annotations

import pytest

from sparsekit.kernels import sp24_plan
from sparsekit.kernels.sp24_plan import SLOTS
from sparsekit.kernels.sp24_rows import smem_bytes


@pytest.mark.parametrize("m,k,n,splits,strips", [
    (4096, 4096, 1, 4, 1), (22016, 4096, 1, 1, 1), (4096, 11008, 1, 8, 1), (8192, 28672, 1, 4, 1),
    (4096, 11008, 16, 4, 1), (4096, 11008, 64, 4, 1), (4096, 4096, 16, 4, 1), (22016, 4096, 64, 1, 1),
    (22016, 4096, 128, 1, 2), (8192, 28672, 128, 2, 2),
    (8192, 28672, 16, 4, 2), (8192, 28672, 32, 4, 2), (8192, 28672, 64, 4, 2),   # H100 sweep, session 12
    (22016, 4096, 16, 1, 1), (22016, 4096, 32, 1, 1),                            # K = 4096: one tile row
])
def test_splits_follow_the_measured_best(m, k, n, splits, strips):
    """docs/kernels-notes.md "v14" and "v15 outcome": the fastest forced plans of the H200 and H100 sweeps
    on these shapes (all-2:4)."""
    gk = -(-k // 64)
    p = sp24_plan.rows_plan(m, gk, n, sms=132, aslot=SLOTS[0])
    assert (p.ks, p.r) == (splits, strips)
    assert (p.ks - 1) * p.per < gk <= p.ks * p.per            # no empty split
    assert p.blocks <= sp24_plan.ROWS_MAX_BLOCKS_PER_SM * 132 or p.ks == 1
    assert p.partial == (p.ks > 1)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 33, 64, 65, 128, 4096])
@pytest.mark.parametrize("aslot", SLOTS)
@pytest.mark.parametrize("strips", [1, 2])
def test_every_plan_fits_shared_memory_and_covers_n(n, aslot, strips):
    p = sp24_plan.rows_plan(4096, 64, n, strips_=strips, aslot=aslot)
    assert p.nt in (8, 16, 32, 64) and 2 <= p.stages <= 4 and p.r == strips
    assert p.dyn == smem_bytes(p.nt, p.stages, p.r, aslot) <= sp24_plan.SMEM_MAX
    assert (p.chunks - 1) * p.nt < n <= p.chunks * p.nt


@pytest.mark.parametrize("m,k,n,kernel", [
    (4096, 4096, 1, "warps"), (4096, 4096, 8, "warps"), (4096, 4096, 16, "rows"), (4096, 4096, 64, "rows"),
    (4096, 4096, 128, "rows"),
    (4096, 11008, 8, "rows"), (4096, 11008, 128, "rows"),
    (22016, 4096, 1, "rows"), (8192, 28672, 1, "rows"), (8192, 28672, 64, "rows"),
    (8192, 576, 1, "warps"),                          # tall but small: sp24_kernel
])
def test_auto_takes_the_kernel_that_measured_faster(m, k, n, kernel):
    assert sp24_plan.kernel_for(m, k, n) == kernel


def test_a_forced_plan_too_big_for_shared_memory_is_one_clear_error():
    with pytest.raises(ValueError, match="shared memory"):
        sp24_plan.rows_plan(4096, 64, 8, stages_=8, aslot=SLOTS[1])
    assert sp24_plan.rows_plan(4096, 64, 8, stages_=8, aslot=SLOTS[0]).stages == 8   # 2:4 only: 46 KB fits


@pytest.mark.parametrize("m,k,n,kernel", [
    (22016, 4096, 1, "rows"), (22016, 4096, 15, "rows"), (22016, 4096, 16, "ws"), (22016, 4096, 64, "ws"),
    (22016, 4096, 256, "ws"), (22016, 4096, 257, "ws"), (22016, 4096, 4096, "ws"),   # prefill too ("v31")
    (28672, 8192, 1, "wg"), (28672, 8192, 16, "wg"), (28672, 8192, 17, "ws"), (28672, 8192, 256, "ws"),
    (28672, 8192, 512, "ws"), (4096, 11008, 2048, "ws"), (12288, 4096, 512, "ws"), (4096, 4096, 2048, "ws"),
    (4096, 4096, 256, "rows"), (4096, 4096, 257, "ws"), (5120, 5120, 4096, "ws"),   # any all-2:4 weight ("v37")
    (8192, 28672, 1, "rows"), (8192, 28672, 8, "rows"), (8192, 28672, 16, "ws"),
    (4096, 11008, 1, "wg"), (4096, 11008, 4, "wg"), (4096, 11008, 5, "rows"), (4096, 14336, 2, "wg"),
    (4096, 4096, 1, "warps"), (5120, 13824, 1, "rows"), (8192, 28672, 128, "ws"), (4096, 11008, 64, "ws"),
    (4096, 4096, 8, "warps"), (4096, 4096, 16, "rows"), (2048, 4096, 32, "warps"), (4096, 4096, 64, "rows"),
    (12288, 4096, 8, "rows"), (12288, 4096, 64, "ws"),
    (8192, 4096, 64, "rows"),
])
def test_auto_takes_the_warpgroup_kernels_only_where_they_measured_faster(m, k, n, kernel):
    assert sp24_plan.kernel_for(m, k, n, wg_ok=True) == kernel
    assert sp24_plan.kernel_for(m, k, n, wg_ok=False) not in ("wg", "ws")   # not Hopper: never
    assert sp24_plan.kernel_for(m, k, n, wg_ok=True, hybrid=True) != "wg"   # dense tiles: never the wg kernel


@pytest.mark.parametrize("m,k,n,kernel", [
    (22016, 4096, 1, "rows"), (22016, 4096, 16, "rows"), (22016, 4096, 17, "ws"), (22016, 4096, 64, "ws"),
    (12288, 4096, 16, "rows"), (12288, 4096, 17, "ws"), (4096, 11008, 32, "rows"), (4096, 11008, 33, "ws"),
    (8192, 4096, 64, "rows"), (4096, 4096, 64, "rows"), (4096, 4096, 127, "rows"), (4096, 4096, 128, "ws"),
    (4096, 4096, 8, "warps"), (8192, 4096, 4096, "ws"),
])
def test_weights_with_dense_tiles_take_sp24_ws_only_from_where_it_measured_faster(m, k, n, kernel):
    """H100 (docs/kernels-notes.md "v38"): rows up to 16 tokens, ws from 17 on weights of WS_MIN_M rows or more,
    from 33 on K-deep ones, from 128 on all."""
    assert sp24_plan.kernel_for(m, k, n, wg_ok=True, hybrid=True) == kernel
    assert sp24_plan.kernel_for(m, k, n, wg_ok=False, hybrid=True) not in ("wg", "ws")   # not Hopper: never


def test_weights_with_dense_tiles_take_one_warpgroup_a_block_where_it_measured_faster():
    """sp24_ws on hybrid weights up to 256 tokens (H100, "v38"): one warpgroup of one tile row on tall weights, and on
    K-deep ones past 32 tokens; two past 256 and on K-deep ones up to 32 (where auto takes sp24_rows)."""
    def groups(m, gk, n):
        return sp24_plan.wg_plan(m, gk, n, specialized=True, hybrid=True)[1:3]

    assert [groups(22016, 64, n) for n in (1, 17, 32, 64, 128, 256)] == [(1, 1)] * 6
    assert [groups(4096, 172, n) for n in (32, 33, 64, 128)] == [(1, 2), (1, 1), (1, 1), (1, 1)]
    assert groups(22016, 64, 512) == groups(4096, 172, 512) == (1, 2)
    assert groups(12288, 64, 32) == (1, 1)
    assert sp24_plan.wg_plan(22016, 64, 32, specialized=True)[1:3] == (2, 2)        # all-2:4 tall: unchanged


@pytest.mark.parametrize("m", [64, 4096, 22016])
@pytest.mark.parametrize("n", [1, 9, 33, 64, 100, 128, 300])
def test_every_wg_plan_fits_and_covers_n(m, n):
    from sparsekit.kernels.sp24_wg import smem_bytes

    gk = 64
    p, r, wg, ks = sp24_plan.wg_plan(m, gk, n)
    assert p.nt in sp24_plan.WG_NTS and 3 <= p.stages <= sp24_plan.WG_STAGES and p.r == r * wg
    assert p.dyn == smem_bytes(p.nt, p.stages, r, wg, ks) <= sp24_plan.WG_SMEM_MAX
    assert (p.chunks - 1) * p.nt < n <= p.chunks * p.nt
    assert p.rb * p.r * 64 >= m > (p.rb - 1) * p.r * 64        # every tile row in exactly one row block
    assert p.blocks == p.tiles * p.ks and (p.ks - 1) * p.per < gk <= p.ks * p.per


@pytest.mark.parametrize("m,gk,n,splits,stages", [
    (4096, 172, 1, 4, 6), (4096, 172, 4, 4, 6), (4096, 224, 2, 4, 6),    # the few-token case (H100 sweep's picks)
    (4096, 172, 5, 8, 4), (8192, 448, 1, 4, 4), (4096, 64, 1, 4, 4),      # elsewhere the rule of rows_splits
])
def test_the_few_token_wg_plan_on_deep_weights_splits_less_with_a_deeper_ring(m, gk, n, splits, stages):
    p = sp24_plan.wg_plan(m, gk, n)[0]
    assert (p.ks, p.stages) == (splits, stages)


def test_a_forced_wg_plan_too_big_is_one_clear_error():
    with pytest.raises(ValueError, match="shared memory"):
        sp24_plan.wg_plan(22016, 64, 128, tokens_=128, stages_=8, strips_=2, groups_=2)


@pytest.mark.parametrize("m,gk,n,splits", [
    (22016, 64, 32, 1), (22016, 64, 64, 1), (22016, 64, 128, 1), (28672, 128, 100, 1),   # tall: no K split
    (8192, 448, 16, 2), (8192, 448, 64, 4), (4096, 172, 32, 4), (4096, 172, 64, 4),     # the H100 sweep's picks
    (12288, 64, 32, 1), (64, 4, 9, 1), (200, 3, 300, 1), (22016, 64, 512, 1), (12288, 64, 2048, 1),
    (4096, 172, 2048, 1), (4096, 172, 512, 2),
])
def test_every_ws_plan_fits_covers_n_and_splits_as_measured(m, gk, n, splits):
    from sparsekit.kernels.sp24_ws import smem_bytes

    p, r, wg, ks = sp24_plan.wg_plan(m, gk, n, specialized=True)
    assert ks == 1 and p.r == r * wg and p.ks == splits
    wide = n > 256 and (m >= 16384 or n >= 1024)                # prefill: 256-token tiles, one row each
    assert wg == (2 if (m >= 16384 or gk * 64 >= 8192 or n > 256) and m > 64 * r else 1)   # one on 12288x4096 ...
    assert p.dyn == smem_bytes(p.nt, p.stages, r, wg) <= sp24_plan.WS_SMEM_MAX
    decode = m < 16384 and n <= 64 and (p.nt <= 32 or wg == 1)  # not tall, one chunk: 8 deep (v36)
    assert p.stages == (8 if decode else 6 if p.nt <= 32 else 4)  # the aligned ring: 4 deep from 64 tokens a tile
    tall128 = m >= 16384 and 64 < n <= 128                      # tall weights: one 128-token tile, 2 x 2 rows
    assert (p.nt, r, wg) == (128, 2, 2) if tall128 else (p.nt, r) == (256, 1) if wide else r * p.nt < 256
    assert (p.chunks - 1) * p.nt < n <= p.chunks * p.nt
    assert p.rb * p.r * 64 >= m > (p.rb - 1) * p.r * 64
    assert p.blocks == p.tiles * p.ks and (p.ks - 1) * p.per < gk <= p.ks * p.per


def test_register_caps_fit_each_quarter_of_the_sm():
    """An SM's 64K registers are four quarters of 16K, each holding a quarter of the block's warps: the fullest
    quarter sets the cap (H100: 9- and 10-warp blocks of 184-186 registers failed to launch, at 168 they run)."""
    from sparsekit.kernels.common import quarter_regs
    from sparsekit.kernels.sp24_ws import max_registers
    from sparsekit.kernels.spmm_ws_plan import max_registers as ws_max

    assert [quarter_regs(w) for w in (4, 5, 8, 9, 10, 11, 12, 13)] == [255 & ~7, 248, 248, 168, 168, 168, 168, 128]
    assert quarter_regs(9, blocks=2) == 96                      # 18 warps: five in the fullest quarter
    for w, regs in [(9, max_registers(128, 2, 2)), (9, max_registers(128, 1, 2)), (10, ws_max(256, 2))]:
        assert regs == 168 and -(-w // 4) * regs * 32 <= 16384
    assert max_registers(8, 1, 1) == 168 and ws_max(64, 1) == 96 # caps below the limit are what ptxas wanted


def test_tall_weights_take_one_128_token_tile_of_two_by_two_rows_from_65_tokens():
    p, r, wg, _ = sp24_plan.wg_plan(22016, 64, 128, specialized=True)
    assert (p.nt, r, wg, p.stages, p.chunks) == (128, 2, 2, 4, 1)
    assert sp24_plan.wg_plan(4096, 172, 128, specialized=True)[0].nt == 64          # not tall: two chunks of 64
    assert sp24_plan.wg_plan(22016, 64, 128, specialized=True, hybrid=True)[1] == 1  # dense tiles: one row each
    assert sp24_plan.wg_plan(22016, 64, 200, specialized=True)[1] == 1               # two chunks: one row each


def test_prefill_takes_256_token_tiles_on_tall_weights_and_from_1024_tokens_elsewhere():
    """sp24_ws past 256 tokens (H100, docs/kernels-notes.md "v31", "v35"): 128 x 256 outputs a block, a ring of 4
    (the ring 128-byte aligned), where they measured fastest; 128-token tiles below 1024 tokens on weights that are not tall, and for dense tiles."""
    p, r, wg, _ = sp24_plan.wg_plan(22016, 64, 2048, specialized=True)
    assert (p.nt, r, wg, p.stages, p.chunks) == (256, 1, 2, 4, 8)
    assert sp24_plan.wg_plan(22016, 64, 257, specialized=True)[0].nt == 256
    assert sp24_plan.wg_plan(12288, 64, 2048, specialized=True)[2] == 2               # ... two warpgroups past 256
    assert sp24_plan.wg_plan(12288, 64, 512, specialized=True)[2] == 2
    assert sp24_plan.wg_plan(4096, 172, 512, specialized=True)[0].nt == 128          # not tall, below 1024
    assert sp24_plan.wg_plan(4096, 172, 1024, specialized=True)[0].nt == 256
    assert sp24_plan.wg_plan(22016, 64, 2048, specialized=True, hybrid=True)[0].nt == 128   # dense tiles


def test_ws_clusters_only_at_prefill_on_all_24_weights_that_are_not_tall():
    """``ws_cluster``: clusters of 2 where the H100 runs measured them faster (weights of fewer than WG_MIN_M rows,
    from WS_CLUSTER_FROM tokens), never for hybrid weights (dense tiles), tall ones or decode-sized token counts."""
    from sparsekit.kernels.sp24_plan import WG_MIN_M, WS_CLUSTER_FROM, ws_cluster

    for m in (64, 4096, 8192, WG_MIN_M - 64):
        assert ws_cluster(m, WS_CLUSTER_FROM) == ws_cluster(m, 4096) == 2
        assert ws_cluster(m, WS_CLUSTER_FROM - 1) == ws_cluster(m, 128) == 1
        assert ws_cluster(m, 4096, hybrid=True) == 1
    assert ws_cluster(WG_MIN_M, 4096) == ws_cluster(22016, 512) == 1


def test_ws_decode_ring_is_deeper_on_all_24_weights_that_are_not_tall():
    """sp24_ws's ring up to 64 tokens (H100, docs/kernels-notes.md "v36"): 8 stages on weights under WG_MIN_M rows
    (32-token tiles, or one warpgroup on all-2:4 ones), 6 on tall weights, 4 from 65 tokens (two chunks)."""
    def stages(m, gk, n, hybrid=False):
        return sp24_plan.wg_plan(m, gk, n, specialized=True, hybrid=hybrid)[0].stages

    assert [stages(12288, 64, n) for n in (1, 16, 32, 64, 65, 128)] == [8, 8, 8, 8, 4, 4]
    assert [stages(4096, 172, n) for n in (1, 32, 64)] == [8, 8, 4]         # K-deep: two warpgroups at 64
    assert [stages(8192, 448, n) for n in (16, 64)] == [8, 4]
    assert [stages(22016, 64, n) for n in (1, 32, 64)] == [6, 6, 4]          # tall
    assert [stages(12288, 64, n, hybrid=True) for n in (16, 32, 64)] == [8, 8, 4]   # dense tiles ("v38")
    assert [stages(22016, 64, n, hybrid=True) for n in (17, 32, 64)] == [6, 6, 4]


@pytest.mark.parametrize("m,k,n,hybrid,kernel", [
    (12288, 4096, 16, False, "rows"), (12288, 4096, 17, False, "ws"), (4096, 11008, 16, False, "rows"),
    (4096, 11008, 32, False, "ws"), (22016, 4096, 16, False, "ws"), (22016, 4096, 1, False, "rows"),
    (28672, 8192, 16, False, "wg"), (4096, 11008, 1, False, "wg"),
    (22016, 4096, 16, True, "ws"), (22016, 4096, 15, True, "rows"), (12288, 4096, 16, True, "rows"),
    (12288, 4096, 17, True, "ws"), (4096, 11008, 31, True, "rows"), (4096, 11008, 32, True, "ws"),
    (4096, 4096, 32, False, "rows"), (4096, 4096, 33, False, "ws"), (4096, 4096, 64, False, "ws"),
    (4096, 4096, 64, True, "ws"), (4096, 4096, 65, False, "rows"), (4096, 4096, 65, True, "rows"),
    (4096, 4096, 128, True, "ws"), (4096, 4096, 512, False, "ws"),
])
def test_fast_memory_moves_only_the_thresholds_the_h200_sweep_moved(m, k, n, hybrid, kernel):
    """H200 (docs/kernels-notes.md "v41"): at 16 tokens sp24_rows beat sp24_ws on 12288x4096 and 4096x11008, and
    sp24_ws beat rows on the tall 22016x4096 with dense tiles, on 4096x11008 with dense tiles at 32 and on 4096x4096 at
    64; the rest as on the H100."""
    moved = {(12288, 16, False), (22016, 16, True), (4096, 16, False), (4096, 32, True), (4096, 33, False),
             (4096, 64, False), (4096, 64, True)}
    assert sp24_plan.kernel_for(m, k, n, wg_ok=True, hybrid=hybrid, fast=True) == kernel
    if (m, n, hybrid) not in moved:
        assert sp24_plan.kernel_for(m, k, n, wg_ok=True, hybrid=hybrid) == kernel   # unchanged elsewhere
    else:
        assert sp24_plan.kernel_for(m, k, n, wg_ok=True, hybrid=hybrid) != kernel
    assert sp24_plan.kernel_for(m, k, n, wg_ok=False, hybrid=hybrid, fast=True) not in ("wg", "ws")


def test_fast_memory_plans_more_blocks_and_one_warpgroup_where_the_h200_measured_them_faster():
    """H200 ("v41"): sp24_rows keeps up to ROWS_MAX_BLOCKS_PER_SM blocks per SM from 16 tokens too (12288x4096 two
    splits, 4096x11008 eight), and sp24_ws takes one warpgroup of one tile row on tall all-2:4 weights up to 64
    tokens (two of two as before at 128, and for dense tiles as before)."""
    assert sp24_plan.rows_plan(12288, 64, 16, aslot=SLOTS[0]).ks == 1
    assert sp24_plan.rows_plan(12288, 64, 16, aslot=SLOTS[0], fast=True).ks == 2
    assert sp24_plan.rows_plan(4096, 172, 16, aslot=SLOTS[0]).ks == 4
    assert sp24_plan.rows_plan(4096, 172, 16, aslot=SLOTS[0], fast=True).ks == 8
    assert sp24_plan.rows_plan(22016, 64, 1, aslot=SLOTS[0], fast=True).ks == 1   # already 4 a SM below 16

    def shape(m, n, hybrid=False):
        p, r, wg, _ = sp24_plan.wg_plan(m, 64, n, specialized=True, hybrid=hybrid, fast=True)
        return r, wg, p.stages

    assert [shape(22016, n) for n in (1, 16, 32, 64)] == [(1, 1, 6)] * 3 + [(1, 1, 4)]
    assert shape(22016, 128)[:2] == (2, 2) == sp24_plan.wg_plan(22016, 64, 32, specialized=True)[1:3]
    assert shape(22016, 32, hybrid=True) == (1, 1, 6)
    assert shape(12288, 32) == (1, 1, 8) == (*sp24_plan.wg_plan(12288, 64, 32, specialized=True)[1:3], 8)

    def deep(n, hybrid=False, fast=True):   # 4096x11008 and 4096x4096: (tile rows, warpgroups, ring, K splits)
        p, r, wg, _ = sp24_plan.wg_plan(4096, 172, n, specialized=True, hybrid=hybrid, fast=fast)
        return r, wg, p.stages, p.ks

    assert deep(32) == (1, 1, 8, 4) and deep(64) == (1, 1, 4, 4) and deep(32, hybrid=True) == (1, 1, 8, 4)
    assert deep(32, fast=False)[1] == deep(128)[1] == 2        # two warpgroups on the H100, and past 64 tokens
    assert sp24_plan.wg_plan(4096, 64, 64, specialized=True, fast=True)[0].ks == 4        # 16 columns a split
    assert sp24_plan.wg_plan(4096, 64, 64, specialized=True)[0].ks == 1
    assert sp24_plan.wg_plan(4096, 64, 512, specialized=True, fast=True)[0].ks == 1       # prefill: unchanged


@pytest.mark.parametrize("m,k,n,hybrid,want", [
    (28672, 8192, 32, False, True),     # 70B's tall weight: the fast plans tied up to 32 tokens
    (28672, 8192, 33, False, False),    # ... and lost at 48-64 (1.36 / 1.42 against 1.47 / 1.52)
    (8192, 28672, 64, False, False),    # 70B's K-deep weight at 48-64 likewise (1.17 / 1.24 against 1.24 / 1.31)
    (8192, 28672, 16, False, True),     # ... but won at 16-32 (1.49 against 1.28 at 16)
    (22016, 4096, 64, False, True),     # 7B's weights are under FAST_BIG: fast plans at every count
    (4096, 11008, 48, False, True),
    (28672, 8192, 16, True, False),     # a tall 70B hybrid up to 16 tokens: 0.87 against 1.20
    (28672, 8192, 17, True, True),
    (8192, 28672, 16, True, True),      # a K-deep one is not tall: fast (1.22 against 0.96)
])
def test_fast_for_takes_the_h100_plans_where_the_h200_measured_them_faster(m, k, n, hybrid, want):
    assert sp24_plan.fast_for(m, k, n, hybrid, True) is want
    assert sp24_plan.fast_for(m, k, n, hybrid, False) is False     # never fast on a GPU without fast memory


def test_fast_for_off_gives_exactly_the_other_plan_set():
    """Where fast_for says no, kernel_for and ws_shape choose as on an H100 (the timed "=0" plans)."""
    m, k, n = 28672, 8192, 64
    fast = sp24_plan.fast_for(m, k, n, False, True)
    assert sp24_plan.kernel_for(m, k, n, True, False, fast) == sp24_plan.kernel_for(m, k, n, True, False, False)
    assert sp24_plan.ws_shape(m, k, 64, n, False, fast) == sp24_plan.ws_shape(m, k, 64, n, False, False)
    assert sp24_plan.ws_shape(m, k, 64, n, False, True) != sp24_plan.ws_shape(m, k, 64, n, False, False)
