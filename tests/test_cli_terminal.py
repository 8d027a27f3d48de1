"""What the commands print at an 80-column terminal (issue 25 item 15): the prune summary keeps each
figure with its unit ("1,381⏎MiB" wrapped), and no stray empty line goes to stderr before a result.
(The perplexity table at 80 columns: tests/test_ppl_baseline.py.)"""
from __future__ import annotations

import re

from rich.console import Console
from typer.testing import CliRunner

from sparsekit.cli.app import app
from sparsekit.cli.prune import summary_table

from test_packing import make_pruned

runner = CliRunner()


def _report(offload: str) -> dict:
    """A prune report as `prune --json` gives it, with the long names and big figures of a real run."""
    layer = {"sparsity": 0.5, "shape": [576, 576], "kind": "linear"}
    return {"model": "/home/someone/models/SmolLM2-135M-Instruct", "method": "wanda", "pattern": "unstructured",
            "sparsity": 0.5, "calibration": {"dataset": "wikitext2", "nsamples": 128, "seqlen": 2048, "seed": 0},
            "device": "cuda:0", "dtype": "float16", "saved_dtype": "bfloat16", "peak_mem_bytes": 1381 * 2**20,
            "peak_host_bytes": 12_345 * 2**20, "offload": offload, "elapsed_s": 61.2, "prune_seconds": 50.1,
            "capture_seconds": 3.3, "overall_sparsity": 0.5, "output": "out/smollm2-135m-wanda-unstructured-50",
            "by_type": {"self_attn.q_proj": {"sparsity": 0.5, "params": 331_776}},
            "layers": {"model.layers.0.self_attn.q_proj": layer},
            "per_layer": [{"index": 0, "linears": ["model.layers.0.self_attn.q_proj"], "seconds": 1.5,
                           "peak_mem_bytes": 1381 * 2**20}]}


def test_the_prune_summary_keeps_figures_with_their_units():
    for offload in ("memory", "disk"):
        console = Console(width=80, record=True)
        console.print(summary_table(_report(offload)))
        text = console.export_text()
        assert "1,381 MiB" in text and "12,345 MiB" in text, text
        assert not re.search(r"\d\s*\n\s*MiB", text), text


def test_no_stray_empty_line_on_stderr(tmp_path):
    make_pruned(tmp_path / "pruned")
    res = runner.invoke(app, ["encode", str(tmp_path / "pruned"), "-o", str(tmp_path / "packed")])
    assert res.exit_code == 0, res.output
    assert res.stderr == ""
