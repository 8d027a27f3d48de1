"""runtime.prefill: the decode-ahead bookkeeping of prefill on packed weights (CPU: no streams, the same
order, buffers and counters as on a GPU; scripts/checks/gpu_prefill.py checks the streams)."""
from __future__ import annotations

import torch
from torch import nn

from sparsekit.runtime.prefill import PrefillPipeline, enable_prefill_pipeline
from sparsekit.runtime.sparse_linear import SparseLinear


def layers(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for o, i in ((96, 64), (64, 130), (200, 64)):     # different shapes; not multiples of 64
        lin = nn.Linear(i, o, bias=False)
        w = torch.randn(o, i, generator=g)
        lin.weight.data = torch.where(torch.rand(o, i, generator=g) < 0.5, torch.zeros(()), w)
        out.append(SparseLinear.from_linear(lin))
    return out


def test_the_order_is_learnt_then_every_weight_comes_from_the_decode_issued_one_layer_ahead():
    a, b, c = ls = layers()
    pipe = PrefillPipeline(ls, torch.device("cpu"))
    ref = {id(m): m.dense_weight() for m in ls}
    seen = []
    for m in (a, b, c, a, b, c, a, b):
        w, slot = pipe.weight(m)
        assert torch.equal(w.view(torch.int16), ref[id(m)].view(torch.int16))   # bit-exact, -0.0 and all
        seen.append(slot)
        pipe.done(slot)
    assert pipe.known and pipe.order == [a, b, c]
    assert (pipe.hits, pipe.misses) == (4, 0)              # b, c, a, b of the second pass came ahead
    assert all(s != t for s, t in zip(seen, seen[1:]))     # consecutive layers never share a buffer
    assert pipe.nbytes() == 2 * 4 * 64 * 64 * 2            # two buffers of the largest padded weight (200x64)


def test_a_call_out_of_order_decodes_at_once_and_the_chain_restarts_from_it():
    a, b, c = ls = layers(1)
    pipe = PrefillPipeline(ls, torch.device("cpu"))
    for m in (a, b, c, a):
        pipe.done(pipe.weight(m)[1])
    w, slot = pipe.weight(c)                               # b was decoded ahead: c is a miss
    assert torch.equal(w, c.dense_weight()) and (pipe.hits, pipe.misses) == (0, 1)
    assert slot != pipe.pending[1]                         # never the buffer the pending decode writes
    pipe.done(slot)
    w, slot = pipe.weight(a)                               # issued after c: a hit again
    assert torch.equal(w, a.dense_weight()) and (pipe.hits, pipe.misses) == (1, 1)


def test_enable_attaches_one_pipeline_and_moving_the_model_drops_it():
    model = nn.Sequential(*layers(2))
    pipe = enable_prefill_pipeline(model)
    assert all(m.prefill_pipeline is pipe for m in model)
    model.to(torch.float32)
    assert all(m.prefill_pipeline is None for m in model)
    assert enable_prefill_pipeline(nn.Sequential(nn.Linear(4, 4))) is None


def test_the_loader_attaches_it_only_when_asked(monkeypatch):
    from sparsekit.errors import SparsekitError
    from sparsekit.runtime.prefill import prefill_ahead_wanted

    monkeypatch.delenv("SPARSEKIT_PREFILL_AHEAD", raising=False)
    assert prefill_ahead_wanted() is False
    monkeypatch.setenv("SPARSEKIT_PREFILL_AHEAD", "1")
    assert prefill_ahead_wanted() is True
    monkeypatch.setenv("SPARSEKIT_PREFILL_AHEAD", "yes")
    try:
        prefill_ahead_wanted()
    except SparsekitError as e:
        assert "SPARSEKIT_PREFILL_AHEAD='yes'" in str(e)
    else:
        raise AssertionError("a bad value must be one error line")
