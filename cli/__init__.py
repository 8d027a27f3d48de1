"""The ``sparsekit`` command line: a thin typer layer over the library API (installed as ``sparsekit.cli``)."""
