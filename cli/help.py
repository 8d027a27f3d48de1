"""How ``--help`` looks at a terminal: typer's rich panels, without a type beside a flag.

typer (0.29) prints the type of every option beside it, ``<bool>`` for flags too (``--help``,
``--version``, ``--json``, ``--overwrite``), which takes a column from the descriptions at 80
columns. A flag takes no value: ``hide_flag_types`` leaves its type cell empty (options that take a
value keep theirs). It patches typer's option class once, and does nothing on a typer without it.
"""
from __future__ import annotations


def hide_flag_types() -> None:
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "hides_flags", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) else shown(self, ctx)

    display_type_rich.hides_flags = True
    TyperOption.display_type_rich = display_type_rich
