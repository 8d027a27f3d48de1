"""Entry point of the ``sparsekit`` console script. Each command lives in its own module."""
from __future__ import annotations

import typer

from sparsekit import __version__
from sparsekit.cli import env as env_cmd
from sparsekit.cli import eval as eval_cmd
from sparsekit.cli import generate as generate_cmd
from sparsekit.cli import pack as pack_cmd
from sparsekit.cli import prune as prune_cmd
from sparsekit.cli import recipes as recipes_cmd
from sparsekit.cli.common import finish, own_process
from sparsekit.cli.help import hide_flag_types

hide_flag_types()   # no <bool> beside --help, --version, --json, ...

app = typer.Typer(
    name="sparsekit",
    help="Prune a Hugging Face causal LM, pack it as TCA-BME, and run it on sparse GPU kernels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool):
    if value:
        typer.echo(f"sparsekit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
):
    """sparsekit: prune -> encode -> eval."""


prune_cmd.register(app)
pack_cmd.register(app)
eval_cmd.register(app)
env_cmd.register(app)
generate_cmd.register(app)
recipes_cmd.register(app)


def main() -> None:
    own_process()   # the console script: process-wide settings are ours to make (common.long_lived)
    try:
        app()
    except SystemExit as e:
        finish(e.code)   # after `generate`: exit without the interpreter's teardown (common.finish)
        raise
    finish(0)


if __name__ == "__main__":
    main()
