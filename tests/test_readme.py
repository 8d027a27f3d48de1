"""The README's examples run as written (issue 25 item 16: its "From Python" block needed the network,
no calib=, and load_packed defaulted to device="cuda", failing on a CPU machine where load works).

The block runs with two names swapped for test-sized ones: the demo model for a tiny Llama, and the
WikiText-2 file for a tiny corpus. Everything else (arguments, defaults, output paths) is the README's.
"""
from __future__ import annotations

import re
from pathlib import Path

from tiny_models import save_tiny, write_corpus

README = Path(__file__).resolve().parents[1] / "README.md"
CALIB = "../shared/data/wikitext-2-raw-v1/validation.stripped-nonblank-lines.txt"


def python_block(after: str) -> str:
    """The first ```python block after the line ``after``."""
    text = README.read_text()
    start = text.index(after)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_the_from_python_block_runs_on_a_cpu_without_network(tmp_path, monkeypatch):
    code = python_block("From Python:")
    assert '"smollm2-135m"' in code and f'"{CALIB}"' in code   # the two names swapped below
    tiny = save_tiny("llama", tmp_path / "tiny")
    corpus = write_corpus(tmp_path / "calib.txt")
    code = code.replace('"smollm2-135m"', repr(str(tiny))).replace(f'"{CALIB}"', repr(str(corpus)))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    assert scope["report"]["output"].endswith("wanda50") and (tmp_path / "out" / "wanda50.tcabme").is_dir()
    assert next(scope["model"].parameters()).device.type == "cpu" and scope["tokenizer"] is not None
    exec(compile(code, str(README), "exec"), {})   # again: it says overwrite=True


def test_the_readme_calib_file_is_the_shared_data(wikitext_dir):
    """The name swapped above is the real file beside the checkout (skipped without ../shared)."""
    assert (README.parent / CALIB).resolve() == (wikitext_dir / Path(CALIB).name).resolve()
