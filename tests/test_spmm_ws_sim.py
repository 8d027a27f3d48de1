"""spmm_ws (issue 21, docs/kernels-notes.md "v19": TCA-BME decoded once per tile into warpgroup A registers,
on sp24_ws's warp-specialized skeleton) against a float64 reference, under Numba's CUDA simulator when there
is no GPU: the producer warp's offset window (32 steps per load, and its reload), GroupTiles with no values
(no copy), two tile rows per block with the second past the weight, M/K padding, token chunks, split-K with
the last-block sum, kept -0.0 values, and a planted bitmap-order bug that must fail. Outputs are poisoned
with NaN first."""
from __future__ import annotations

import pytest
import torch

from sparsekit.kernels.common import SIM
from sparsekit.kernels.spmm_ws import tcabme_ws_matmul
from sparsekit.kernels.spmm_ws_plan import SMEM_RESERVED, max_registers, ws_plan
from sparsekit.packed.tcabme import TcaBme, encode

from tests.test_spmm_rows_sim import _weight

DEV = "cpu" if SIM else "cuda"
pytestmark = pytest.mark.warpgroup_sim   # conftest: the switch interval of the warpgroup kernels
if not SIM and not torch.cuda.is_available():  # pragma: no cover - conftest sets the simulator
    pytest.skip("neither the CUDA simulator nor a GPU", allow_module_level=True)


def _rel_err(p, w, x, **knobs):
    m, n = w.shape[0], x.shape[0]
    out = torch.full((n, m), float("nan"), dtype=torch.float16, device=DEV)   # poisoned
    y = tcabme_ws_matmul(x.to(DEV), p.to(DEV), out=out, **knobs)
    assert y is out
    assert not torch.isnan(y).any(), "some outputs were never written"
    ref = x.double() @ w.double().t()
    return ((y.cpu().double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("m,k,n,kind,knobs", [
    (64, 128, 1, 0.5, dict(groups=1)),                         # one warpgroup, 8 tokens, 2 steps
    (130, 100, 9, 0.3, dict(groups=2, tokens=8, stages=2)),    # M/K padding; the last block's 2nd row past M;
                                                               # a 2-stage ring; 2 token chunks
    (64, 64 * 9, 1, "strips", dict(groups=1, stages=3, window=4)),  # 9 steps, offsets loaded 4 steps at a time
                                                               # (two reloads); zero, dense, 50%, 2:4 strips
    (64, 192, 9, 0.5, dict(groups=1, splits=2, tokens=8)),     # split-K (2 + 1 columns) + fixup; 2 chunks
    (70, 64 * 3, 1, 0.5, dict(alt=True, tokens=8, stages=4)),  # two warpgroups taking turns on a tile row: an
                                                               # odd step count (2 + 1), M padding
    (64, 64, 1, 0.5, dict(alt=True, stages=2)),                # one step: the second warpgroup adds zeros
    (64, 64 * 4, 1, 0.5, dict(alt=True, splits=2, stages=2)),  # turns inside each K split, then the fixup
])
def test_spmm_ws_matches_float64(m, k, n, kind, knobs):
    w, g = _weight(m, k, kind, seed=m + n, negzeros=3 if kind == 0.5 else 0)
    x = torch.randn(n, k, generator=g).half()
    p = encode(w)
    for _ in range(2 if knobs.get("splits") else 1):           # a split-K counter left set fails the second
        assert _rel_err(p, w, x, **knobs) < 1e-3


@pytest.mark.parametrize("alt", [False, True])
def test_time_stamp_probe_gives_the_product_and_ordered_stamps(alt):
    """The stamped build (``spmm_ws_probe``, a diagnostic) computes the same product, and each role's stamps
    follow its own order within every step it ran (with ``alt``, each step stamped by the warpgroup that took
    it)."""
    from sparsekit.kernels.spmm_ws_probe import ws_stamps

    w, g = _weight(64, 64 * 5, 0.5, seed=5)
    x = torch.randn(1, 64 * 5, generator=g).half()
    y, st, plan = ws_stamps(x.to(DEV), encode(w).to(DEV), groups=None if alt else 1, stages=2, alt=alt)
    ref = x.double() @ w.double().t()
    assert ((y.cpu().double() - ref).norm() / ref.norm()).item() < 1e-3
    assert plan["blocks"] == 1 and st.shape == (1, plan["steps"], 8) and plan["steps"] == 5
    assert plan["sm"].tolist() == [0] and ((plan["end_ns"] - plan["start_ns"]) & 0xFFFFFFFF).item() > 0
    st = st[0].cpu()
    assert (st[:, :5].diff(dim=1) >= 0).all() and (st[:, 5] <= st[:, 6]).all()   # consumer; copy warp
    for slot in (5, 7):                                        # each role's steps, one after another
        assert (st[:, slot].diff() >= 0).all() and st[-1, slot] > 0
    for own in ([st[0::2], st[1::2]] if alt else [st]):       # the consumers': per warpgroup with alt
        assert (own[:, 0].diff() >= 0).all() and own[-1, 0] > 0


def test_spmm_ws_copies_nothing_for_an_all_zero_tile():
    w, g = _weight(64, 128, 0.5, seed=3)
    w[:, 64:] = 0
    x = torch.randn(2, 128, generator=g).half()
    p = encode(w)
    assert int(p.gtile_offsets[2] - p.gtile_offsets[1]) == 0
    assert _rel_err(p, w, x, groups=1) < 1e-3
    p0 = encode(torch.zeros(64, 64, dtype=torch.float16))      # no values at all
    out = tcabme_ws_matmul(x[:, :64].to(DEV), p0.to(DEV), groups=1)
    assert (out == 0).all()


def test_spmm_ws_catches_a_planted_bitmap_order_bug():
    """BitmapTiles bottom-left and top-right swapped in every TCTile (a column-major order read row-major)."""
    w, g = _weight(64, 128, 0.5, seed=5)
    x = torch.randn(3, 128, generator=g).half()
    p = encode(w)
    bm = p.bitmaps.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(-1)
    bad = TcaBme(bitmaps=bm, values=p.values, gtile_offsets=p.gtile_offsets, strip_offsets=p.strip_offsets,
                 shape=p.shape)
    assert _rel_err(p, w, x, groups=1) < 1e-3
    assert _rel_err(bad, w, x, groups=1) > 0.1


def test_spmm_ws_plan_fits():
    sm = 228 * 1024
    for m, gk, n in [(22016, 64, 1), (22016, 64, 64), (4096, 172, 32), (8192, 448, 128), (100, 2, 5)]:
        p, r, wg = ws_plan(m, gk, n, vbytes=4624)
        assert r == 1 and p.r == wg == 1 and p.nt >= min(n, 128) and 2 <= p.stages <= 4
        assert p.blocks == p.tiles * p.ks and p.per * p.ks >= gk > p.per * (p.ks - 1)
        fit = 65536 // (-(-max_registers(p.nt, 1) * 32 // 256) * 256 * 6)
        assert fit * (p.dyn + SMEM_RESERVED) <= sm                # the ring leaves room for every resident block
        assert p.ks == 1 or p.blocks <= fit * 132                 # a K split only fills the block slots
    assert ws_plan(22016, 64, 64)[0].ks == 1                      # tall: one block per tile row
    assert ws_plan(4096, 172, 32)[0].ks > 1                       # few tile rows: K split toward the SMs
    small, dense = ws_plan(4096, 172, 32, vbytes=4624)[0], ws_plan(4096, 172, 32)[0]
    assert small.dyn // small.stages < dense.dyn // dense.stages and small.stages > dense.stages  # room per weight
    with pytest.raises(ValueError, match="shared memory"):
        ws_plan(22016, 64, 128, tokens=128, stages=8, groups=2)


def test_default_plan_takes_spmm_ws_where_it_won():
    """The H100 sweep of session 15: spmm_ws beat spmm_warp from 32 tokens on the largest weights (22016x4096,
    8192x28672, 28672x8192) and from 64 on 4096x11008 and 12288x4096; spmm_warp kept 4096x4096 and every
    shape to 16 tokens."""
    from sparsekit.kernels.matmul import ws_wanted

    for m, k in [(22016, 4096), (8192, 28672), (28672, 8192)]:
        assert not ws_wanted(m, k, 16) and ws_wanted(m, k, 32) and ws_wanted(m, k, 128)
    for m, k in [(4096, 11008), (12288, 4096)]:
        assert not ws_wanted(m, k, 32) and ws_wanted(m, k, 64)
    assert not any(ws_wanted(4096, 4096, n) for n in (1, 16, 32, 64, 128))


def test_spmm_ws_is_self_tested_before_first_use_and_a_failure_is_said(monkeypatch):
    import warnings

    from sparsekit.errors import SparsekitWarning
    from sparsekit.kernels import matmul

    monkeypatch.delenv("SPARSEKIT_STRICT", raising=False)
    matmul.reset_kernel_choice()
    matmul.ws_self_test(torch.device(DEV))                    # the real check passes (simulator or GPU)
    monkeypatch.setattr(matmul, "ws_self_test", lambda device: (_ for _ in ()).throw(RuntimeError("off by 0.5")))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert matmul.ws_checked(torch.device(DEV)) is False
        assert matmul.ws_checked(torch.device(DEV)) is False  # checked once
    matmul.reset_kernel_choice()
    said = [str(w.message) for w in seen if issubclass(w.category, SparsekitWarning)]
    assert len(said) == 1 and "spmm_ws" in said[0] and "off by 0.5" in said[0]


def test_spmm_ws_cluster_plan_pads_the_tile_rows_and_refuses_what_it_cannot_share():
    """Clusters (docs/kernels-notes.md "v22") take whole clusters of neighbouring tile rows, all of K each, one
    warpgroup a block: 345 tile rows in clusters of 2 need 346 blocks per token chunk."""
    p, _, wg = ws_plan(22016 + 64, 64, 64, cluster=2)
    assert p.ks == 1 and wg == 1 and p.rb == 345 and p.blocks == 346 * p.chunks
    assert ws_plan(22016, 64, 200, cluster=4)[0].blocks == 344 * 2          # two token chunks, 86 clusters each
    assert ws_plan(4096, 172, 32)[0].ks > 1 and ws_plan(4096, 172, 32, cluster=2)[0].ks == 1
    for bad in (dict(cluster=3), dict(cluster=2, splits=2), dict(cluster=2, groups=2)):
        with pytest.raises(ValueError):
            ws_plan(4096, 172, 32, **bad)


@pytest.mark.skipif(not SIM, reason="the simulator's refusal")
def test_spmm_ws_clusters_are_refused_in_the_simulator_in_one_line():
    w = torch.where(torch.rand(64, 64) < 0.5, torch.randn(64, 64), 0.0).half()
    with pytest.raises(ValueError, match="GPU only"):
        tcabme_ws_matmul(torch.randn(1, 64).half(), encode(w), cluster=2)


class _Bar:
    """An mbarrier: arrivals and transaction bytes per phase; ``done(k)``: phase ``k`` has completed."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phases = count, count, 0, 0

    def arrive(self, nbytes: int = 0):
        self.pending, self.tx = self.pending - 1, self.tx + nbytes
        self.settle()

    def land(self, nbytes: int):
        self.tx -= nbytes
        self.settle()

    def settle(self):
        if self.pending == 0 and self.tx == 0:
            self.phases, self.pending = self.phases + 1, self.count

    def done(self, k: int) -> bool:
        return self.phases > k


def _cluster_protocol(ranks: int, stages: int, steps: int, seed: int, leader_waits: bool = True) -> list[str]:
    """spmm_ws's cluster protocol (docs/kernels-notes.md "v22"; the copy warp of ``_build`` with CL > 1), run
    in a random interleaving of every rank's copy warp and consumers and of the copies' landings. Returns the
    violations: a multicast into a stage a rank has not yet released, a consumer taking a step whose bytes
    are not all there, or a deadlock."""
    import random

    rnd = random.Random(seed)
    X, W = 7, 5                                        # bytes of the X slab and of a rank's own GroupTile
    raw = [[_Bar(1) for _ in range(stages)] for _ in range(ranks)]
    empty = [[_Bar(1) for _ in range(stages)] for _ in range(ranks)]
    xempty = [_Bar(ranks) for _ in range(stages)]      # the leader's
    released = [0] * ranks                             # steps each rank's consumers are done with
    landed = [[0] * steps for _ in range(ranks)]       # bytes of each step in each rank's stage
    flights: list = []                                 # copies issued, not landed: (rank, step, bytes)
    bad: list[str] = []

    def copier(r):
        for i in range(steps):
            s = i % stages
            if i >= stages:
                yield lambda: empty[r][s].done(i // stages - 1)
            raw[r][s].arrive(X + W)                    # the expect
            xempty[s].arrive()                         # remote, to the leader
            flights.append((r, i, W))
            if r == 0:
                if leader_waits:
                    yield lambda: xempty[s].done(i // stages)
                for q in range(ranks):
                    if released[q] < i - stages + 1:
                        bad.append(f"X of step {i} multicast into rank {q}'s stage before it released step "
                                   f"{i - stages}")
                    flights.append((q, i, X))

    def consumer(r):
        for i in range(steps):
            s = i % stages
            yield lambda: raw[r][s].done(i // stages)
            if landed[r][i] != X + W:
                bad.append(f"rank {r} took step {i} with {landed[r][i]} of {X + W} bytes")
            released[r] = i + 1
            empty[r][s].arrive()

    procs = [[p, None] for r in range(ranks) for p in (copier(r), consumer(r))]
    while procs or flights:
        ready = [p for p in procs if p[1] is None or p[1]()]
        if not ready and not flights:
            return bad + ["deadlock"]
        if flights and (not ready or rnd.random() < 0.5):
            r, i, n = flights.pop(rnd.randrange(len(flights)))
            landed[r][i] += n
            raw[r][i % stages].land(n)
            continue
        p = rnd.choice(ready)
        try:
            p[1] = next(p[0])
        except StopIteration:
            procs.remove(p)
    return bad


def test_spmm_ws_cluster_protocol_is_safe_and_live_in_any_interleaving():
    """A model of the cluster protocol in 300 random interleavings per shape: no multicast into a stage a
    rank still reads, no step taken short of bytes, no deadlock; without the leader's wait it breaks."""
    for ranks, stages in ((2, 2), (2, 4), (4, 3)):
        for seed in range(100):
            assert _cluster_protocol(ranks, stages, 10, seed) == []
    assert any(_cluster_protocol(2, 2, 10, seed, leader_waits=False) for seed in range(100))
