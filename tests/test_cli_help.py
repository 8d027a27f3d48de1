"""`--help` at an 80-column terminal (issue 25 items 14 and 15): no text lost to rich markup
(`pip install "sparsekit[tasks]"` showed as `pip install "sparsekit"`), no `<bool>` beside flags, one
kind of usage placeholder (`{pruned}` stood beside `[DIR]`), and prune's descriptions readable (they
were squeezed into about 18 columns, six of them cut with "…")."""
from __future__ import annotations

import re

import pytest
import typer
from rich.text import Text
from typer.testing import CliRunner

from sparsekit.cli.app import app

runner = CliRunner()
COMMANDS = ["prune", "encode", "inspect", "verify", "export-bitmask", "import-bitmask", "eval", "env", "generate",
            "recipes"]


def help_of(*args: str) -> str:
    res = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    return res.stdout


def _texts():
    """Every help text of the CLI: the commands' and their parameters'."""
    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        yield name, cmd.help or ""
        for p in cmd.params:
            yield f"{name} {p.name}", getattr(p, "help", None) or ""


def test_no_help_text_is_read_as_markup():
    lost = [where for where, text in _texts() if Text.from_markup(text).plain != text.replace("\\[", "[")]
    assert lost == []
    assert "the optional `sparsekit[tasks]` extra" in " ".join(help_of("eval").split())


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_flags_show_no_type(command):
    out = help_of(*([command] if command else []))
    assert "<bool>" not in out and "--help" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_usage_placeholders_are_upper_case(command):
    usage = next(line for line in help_of(command).splitlines() if "Usage:" in line)
    pieces = usage.split("[OPTIONS]", 1)[1].split()
    assert all(re.fullmatch(r"\{[A-Z_]+\}|\[[A-Z_]+\]", p) for p in pieces), usage


def test_prune_help_is_readable_at_80_columns():
    out = help_of("prune")
    assert "…" not in out
    rows = [line for line in out.splitlines() if line.startswith("│ --method")]
    assert rows and rows[0].index("magnitude") <= 80 - 38, rows   # 36 columns or more for each description
