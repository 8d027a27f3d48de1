"""sparsekit.torch_compat: the reaches past torch's public API behave as the public calls they stand for."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sparsekit.torch_compat import assume_constant_result


def test_the_constant_mark_made_without_dynamo_is_the_one_torch_makes(monkeypatch):
    def theirs():
        return 1

    def ours():
        return 1

    torch.compiler.assume_constant_result(theirs)        # imports torch._dynamo
    monkeypatch.delitem(sys.modules, "torch._dynamo")    # as in a process that never compiled
    assert assume_constant_result(ours) is ours
    monkeypatch.undo()
    assert vars(ours) == vars(theirs) and vars(ours)     # the same marker, set to the same value


def test_a_compiled_function_takes_the_marked_result_as_a_constant(monkeypatch):
    calls = []

    def untraceable(n: int) -> int:      # a list append inside: Dynamo would trace it into the graph's guards,
        calls.append(n)                  # but a constant function runs once, at trace time
        return n * 2

    monkeypatch.delitem(sys.modules, "torch._dynamo")
    marked = assume_constant_result(untraceable)
    monkeypatch.undo()

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return x + marked(3)

    torch._dynamo.reset()
    assert torch.equal(f(torch.zeros(2)), torch.full((2,), 6.0))
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 7.0))
    assert calls == [3]                  # evaluated when traced, not at every call


def test_the_runtime_import_and_an_eager_sparse_layer_never_import_dynamo():
    """``generate`` never compiles: importing the runtime and running a packed layer eagerly must not pay for
    ``torch._dynamo`` (~1.2 s, issue 20's wall-time budget)."""
    code = ("import sys, torch\n"
            "import sparsekit.cli.app, sparsekit.runtime.generate, sparsekit.runtime.loader\n"
            "from sparsekit.runtime.sparse_linear import SparseLinear\n"
            "lin = torch.nn.Linear(64, 32, bias=False)\n"
            "layer = SparseLinear.from_linear(lin)\n"
            "layer(torch.randn(3, 64))\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
