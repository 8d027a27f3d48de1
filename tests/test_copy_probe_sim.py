"""The bulk-copy probe (``kernels/copy_probe.py``, docs/kernels-notes.md "v23"), a diagnostic: under the simulator
every step of every block lands in its ring, in several copies a step, held or not, and the sum of the words the reader saw
is each block's share of the source's step heads."""
from __future__ import annotations

import pytest
import torch

from sparsekit.kernels.common import SIM
from sparsekit.kernels.copy_probe import bulk_stream

DEV = "cpu" if SIM else "cuda"
if not SIM and not torch.cuda.is_available():  # pragma: no cover - conftest sets the simulator
    pytest.skip("neither the CUDA simulator nor a GPU", allow_module_level=True)


@pytest.mark.parametrize("stages,pieces,hold", [(2, 1, 0), (3, 3, 2)])
def test_bulk_stream_lands_every_step(stages, pieces, hold):
    src = torch.randint(0, 1 << 20, (2 * 7 * 48,), dtype=torch.int64).to(DEV)
    sink = bulk_stream(src, 2, 48 * 8, stages=stages, pieces=pieces, hold=hold)
    assert torch.equal(sink.cpu(), src.cpu().view(2, 7, 48)[:, :, 0].sum(dim=1))


def test_bulk_stream_laps_read_each_share_again():
    src = torch.randint(0, 1 << 20, (2 * 3 * 16,), dtype=torch.int64).to(DEV)
    sink = bulk_stream(src, 2, 16 * 8, stages=2, laps=3)
    assert torch.equal(sink.cpu(), 3 * src.cpu().view(2, 3, 16)[:, :, 0].sum(dim=1))
    with pytest.raises(ValueError, match="laps"):
        bulk_stream(src, 2, 16 * 8, laps=0)


def test_bulk_stream_refuses_pieces_that_are_not_whole_copies():
    with pytest.raises(ValueError, match="multiple of 16"):
        bulk_stream(torch.zeros(64, dtype=torch.int64, device=DEV), 1, 40 * 8, pieces=3)


def test_shared_parts_come_from_the_groups_share():
    """Blocks 0-1 and 2-3 (``share=2``) each read a group's common tail: block b's tail words are block b // 2's,
    so the sums differ from ``share=1`` exactly by the tails; the reference says the same."""
    from sparsekit.kernels.copy_probe import stream_sums

    src = torch.randint(0, 1 << 20, (4 * 3 * 32,), dtype=torch.int64).to(DEV)
    steps = src.cpu().view(4, 3, 32)
    sink = bulk_stream(src, 4, 32 * 8, stages=2, pieces=2, shared_bytes=16 * 8, share=2, laps=2)
    want = 2 * (steps[:, :, 0] + steps[[0, 0, 1, 1], :, 16]).sum(dim=1)
    assert torch.equal(sink.cpu(), want)
    assert torch.equal(stream_sums(src, 4, 32 * 8, laps=2, shared_bytes=16 * 8, share=2).cpu(), want)
    alone = bulk_stream(src, 4, 32 * 8, stages=2, shared_bytes=32 * 8, share=1)   # all shared, each its own
    assert torch.equal(alone.cpu(), steps[:, :, 0].sum(dim=1))
    with pytest.raises(ValueError, match="shared_bytes"):
        bulk_stream(src, 4, 32 * 8, shared_bytes=8)
    with pytest.raises(ValueError, match="cluster"):
        bulk_stream(src, 4, 32 * 8, cluster=3)
    with pytest.raises(ValueError, match="split"):   # two slices of 48 bytes are not whole 16-byte pieces
        bulk_stream(src, 4, 32 * 8, shared_bytes=48, cluster=2, split=True)
    if SIM:
        with pytest.raises(RuntimeError, match="cluster"):
            bulk_stream(src, 4, 32 * 8, shared_bytes=16 * 8, cluster=2)
        with pytest.raises(RuntimeError, match="tensor maps"):
            bulk_stream(src, 4, 32 * 8, tma_box=1)
    else:
        with pytest.raises(ValueError, match="whole boxes"):   # an own part of 128 bytes, boxes of 256
            bulk_stream(src, 4, 32 * 8, shared_bytes=16 * 8, tma_box=2)


def test_the_blocks_say_where_they_ran():
    src = torch.randint(0, 1 << 20, (3 * 2 * 16,), dtype=torch.int64).to(DEV)
    where = torch.full((3,), -1, dtype=torch.int64, device=DEV)
    sink = bulk_stream(src, 3, 16 * 8, stages=2, sms=where)
    assert sink.shape == (3,) and torch.equal(sink.cpu(), src.cpu().view(3, 2, 16)[:, :, 0].sum(dim=1))
    assert (where >= 0).all() and (not SIM or (where == 0).all())   # the simulator has one SM
