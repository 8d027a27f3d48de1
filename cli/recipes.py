"""sparsekit recipes: the bundled pruning recipes, one line each (``--recipe NAME`` takes the name)."""
from __future__ import annotations

import typer
from rich.markup import escape

from sparsekit.cli.common import JSON_OPTION, console, emit_json, handle_errors

HELP = (
    "List the bundled pruning recipes: name, method / pattern / sparsity, and description.\n\n"
    "Pass a name to `sparsekit prune --recipe NAME` from any folder (a YAML file path works too; "
    "flags override the recipe).\n\n"
    "Example: sparsekit prune smollm2-135m --recipe wanda-2of4 -o out/wanda24"
)


def register(app: typer.Typer) -> None:
    app.command("recipes", help=HELP)(recipes_cmd)


def recipe_rows() -> list[dict]:
    """One dict per bundled recipe: name, description, method, pattern, sparsity (resolved), cats
    (stacked CATS target or None), allocation, refine, update (None when unset), path."""
    from sparsekit.pruning.recipes import bundled_recipes, resolve_settings

    rows = []
    for r in bundled_recipes():
        s = resolve_settings(r.name)
        rows.append({"name": r.name, "description": r.description, "method": s.method, "pattern": s.pattern,
                     "sparsity": s.sparsity, "cats": s.cats, "allocation": s.allocation, "refine": s.refine,
                     "update": s.update, "path": r.path})
    return rows


@handle_errors
def recipes_cmd(json_out: bool = JSON_OPTION) -> None:
    from sparsekit.errors import SparsekitError

    rows = recipe_rows()
    if not rows:
        raise SparsekitError("no bundled recipes found: the sparsekit.recipes data package is missing, reinstall sparsekit")
    if json_out:
        emit_json(rows)
        return
    width = max(len(r["name"]) for r in rows)
    spec_width = max(len(_spec(r)) for r in rows)
    for r in rows:
        console.print(f"[bold]{escape(r['name']):<{width}}[/]  {escape(_spec(r)):<{spec_width}}  {escape(r['description'])}",
                      highlight=False, soft_wrap=True)


def _spec(r: dict) -> str:
    extra = [f"{r['allocation']} allocation"] if r.get("allocation", "layer") != "layer" else []
    extra += [f"{r[k]} {k}" for k in ("refine", "update") if r.get(k)]
    return (f"{r['method']} {r['pattern']} {r['sparsity']:.4g}" + (f" + cats {r['cats']:.4g}" if r.get("cats") is not None else "")
            + "".join(f" + {e}" for e in extra))
