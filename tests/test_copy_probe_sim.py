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
