"""sparsekit encode / inspect / verify / export-bitmask / import-bitmask: the TCA-BME format commands."""
from __future__ import annotations

import os
import re

import contextlib
from pathlib import Path

import typer
from typing import Optional

from sparsekit.cli.common import JSON_OPTION, console, emit_json, err_console, handle_errors

ENCODE_HELP = (
    "Pack a pruned HF checkpoint (dense weights with zeros) as TCA-BME safetensors shards.\n\n"
    "Each decoder linear weight is packed when packing gains something for it: when its TCA-BME bytes are at "
    "least 5% below its dense bytes (about 11% zeros or more, whatever the pattern); otherwise it stays dense "
    "and the reason is recorded. --min-sparsity S packs by a sparsity threshold instead; --force packs every layer. Embeddings, norms, lm_head and biases "
    "are stored as they are; config, tokenizer and sparsekit.json are copied, so OUT is self-contained. "
    "float32 checkpoints are cast to float16 (bfloat16 if the config says so).\n\n"
    "Example: sparsekit encode out/wanda50 -o out/wanda50.tcabme"
)
INSPECT_HELP = (
    "Show each linear layer of a packed checkpoint: shape, sparsity, dense bytes, packed bytes and "
    "compression ratio, with totals. Reads the index and shard headers only: checksums are not checked "
    "(run `sparsekit verify`).\n\nExample: sparsekit inspect out/wanda50.tcabme"
)
VERIFY_HELP = (
    "Check a packed checkpoint: index, format version, shard sizes and sha256, and the structure of every "
    "packed weight (offsets monotone and multiples of 8, popcounts match value counts, strip offsets and "
    "shapes consistent); and that it loads: config.json present and readable by transformers, its model "
    "fits the packed layers, tokenizer files present. Exits 2 with one line naming the problem (shard and "
    "tensor for a damaged shard) on the first one.\n\n"
    "Example: sparsekit verify out/wanda50.tcabme"
)
EXPORT_HELP = (
    "Write a pruned or packed sparsekit checkpoint as a compressed-tensors 'sparse-bitmask' checkpoint "
    "(the sparse format of llm-compressor).\n\nExample: sparsekit export-bitmask out/wanda50.tcabme -o out/wanda50.ct"
)
IMPORT_HELP = (
    "Rebuild a dense pruned HF checkpoint from a compressed-tensors 'sparse-bitmask' checkpoint, ready for "
    "`sparsekit encode` or `sparsekit eval`.\n\nExample: sparsekit import-bitmask llmc-model -o out/imported"
)


DELETE_EXTRA = typer.Option(False, "--delete-extra", help="With --overwrite: also delete files in the old output "
                            "that sparsekit did not write (refused otherwise).")


def register(app: typer.Typer) -> None:
    app.command("encode", help=ENCODE_HELP)(encode_cmd)
    app.command("inspect", help=INSPECT_HELP)(inspect_cmd)
    app.command("verify", help=VERIFY_HELP)(verify_cmd)
    app.command("export-bitmask", help=EXPORT_HELP)(export_cmd)
    app.command("import-bitmask", help=IMPORT_HELP)(import_cmd)


@contextlib.contextmanager
def _progress(description: str, enabled: bool = True):
    """A rich progress bar on stderr; yields a ``sparsekit.progress.Progress`` callback."""
    if not enabled or not err_console.is_terminal:  # (off a terminal a transient bar leaves an empty line)
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[what]}"), console=err_console, transient=True) as bar:
        task = bar.add_task(description, total=None, what="")

        def update(stage: str, done: int, total: int, item: str = "") -> None:
            bar.update(task, completed=done, total=total, what=item[-60:])

        yield update


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f}"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}"


@handle_errors
def encode_cmd(
    pruned: Path = typer.Argument(..., metavar="PRUNED", help="Pruned HF checkpoint directory (output of `sparsekit prune`)."),
    output: Path = typer.Option(..., "-o", "--output", help="Output directory for the packed checkpoint."),
    min_sparsity: Optional[float] = typer.Option(None, "--min-sparsity", help="Pack layers with at least this fraction of zeros instead of by the bytes packing saves (default: by bytes)."),
    force: bool = typer.Option(False, "--force", help="Pack every linear layer, however dense."),
    max_shard_size: str = typer.Option("2GB", "--max-shard-size", help="Largest shard file, e.g. 2GB, 500MB."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
    delete_extra: bool = DELETE_EXTRA,
    json_out: bool = JSON_OPTION,
):
    from sparsekit.packed.encoding import encode_checkpoint

    with _progress("encoding") as progress:
        report = encode_checkpoint(pruned, output, min_sparsity=min_sparsity, force=force, max_shard_size=max_shard_size,
                        overwrite=overwrite, progress=progress, delete_extra=delete_extra)
    if json_out:
        emit_json(report)
        return
    dense_n = report["dense_layers"]
    console.print(
        f"[bold green]packed[/] {report['packed_layers']}/{report['layers']} linear layers into {report['output']} "
        f"({report['shards']} shard{'s' if report['shards'] != 1 else ''}, {report['elapsed_s']:.1f} s)"
    )
    console.print(
        f"linear weights: {_mb(report['linear_dense_bytes'])} MB dense -> {_mb(report['linear_stored_bytes'])} MB "
        f"stored (ratio {_ratio(report['ratio'])})"
    )
    if report["cast_from"]:
        console.print(f"note: {report['cast_from']} weights were cast to {report['dtype']}")
    if dense_n:
        name, info = next((n, i) for n, i in report["per_layer"].items() if not i["packed"])
        console.print(f"{dense_n} layer{'s' if dense_n != 1 else ''} kept dense (see `sparsekit inspect`), e.g. "
                      f"{name}: {info['reason']}", highlight=False)


def _natural_key(name: str):
    """model.layers.10.x after model.layers.9.x: digits compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def inspect_table(report: dict):
    from rich import box
    from rich.table import Table

    meta = report["metadata"]
    rows = sorted(report["layers"], key=lambda r: _natural_key(r["layer"]))
    # Drop the prefix every layer shares ("model.layers.") so the table fits a terminal.
    prefix = os.path.commonprefix([r["layer"] for r in rows]) if len(rows) > 1 else ""
    prefix = prefix[: prefix.rfind(".") + 1]
    title = (f"{report['path']}  (format {meta.get('format')} v{meta.get('format_version')}, "
             f"source {meta.get('source_model')})")
    caption = "sizes in MB; 'stored' total: packed / all layers" + (f"; layers under {prefix}" if prefix else "")
    t = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=0)
    for head, justify in (("layer", "left"), ("shape", "right"), ("sparsity", "right"), ("pattern", "left"),
                          ("stored", "left"), ("dense", "right"), ("packed", "right"), ("ratio", "right")):
        t.add_column(head, justify=justify, overflow="fold", no_wrap=head in ("layer", "shape"))
    for r in rows:
        t.add_row(r["layer"][len(prefix):], "x".join(str(s) for s in r["shape"] or []),
                  "-" if r["sparsity"] is None else f"{r['sparsity']:.1%}", str(r["pattern"] or "-"),
                  "tcabme" if r["packed"] else "dense", _mb(r["dense_bytes"]), _mb(r["packed_bytes"]),
                  _ratio(r["ratio"]))
    tot = report["totals"]
    t.add_section()
    t.add_row("total", "", "-" if tot["sparsity"] is None else f"{tot['sparsity']:.1%}", "",
              f"{tot['packed_layers']}/{tot['layers']}",
              _mb(tot["dense_bytes"]), _mb(tot["packed_bytes"]), _ratio(tot["ratio"]), style="bold")
    return t


@handle_errors
def inspect_cmd(
    packed: Path = typer.Argument(..., metavar="PACKED", help="Packed checkpoint directory (output of `sparsekit encode`)."),
    json_out: bool = JSON_OPTION,
):
    from sparsekit.packed.verify import inspect_packed

    report = inspect_packed(packed)
    if json_out:
        emit_json(report)
        return
    console.print(inspect_table(report))
    tot = report["totals"]
    console.print(f"other tensors (embeddings, norms, lm_head, biases): {_mb(tot['other_bytes'])} MB; "
                  f"checkpoint: {_mb(tot['checkpoint_bytes'])} MB in {tot['shards']} shard(s)")
    dense = [r for r in report["layers"] if not r["packed"]]
    for r in dense[:5]:
        console.print(f"[dim]{r['layer']}: {r['reason']}[/]")
    if len(dense) > 5:
        console.print(f"[dim]... and {len(dense) - 5} more dense layers[/]")
    if not report.get("checksums_verified"):
        console.print("checksums not checked: run `sparsekit verify` to check the shards' bytes")


@handle_errors
def verify_cmd(
    packed: Path = typer.Argument(..., metavar="PACKED", help="Packed checkpoint directory (output of `sparsekit encode`)."),
    json_out: bool = JSON_OPTION,
):
    from sparsekit.packed.verify import verify_packed

    with _progress("verifying") as progress:
        report = verify_packed(packed, progress=progress)
    if json_out:
        emit_json(report)
        return
    console.print(f"[bold green]ok[/]: {report['path']} ({report['format']} v{report['format_version']}): "
                  f"{report['shards']} shard(s), {report['tensors']} tensors, {report['packed_layers']}/"
                  f"{report['layers']} layers packed, checksums and structure verified, config and tokenizer present"
                  + ("; transformers' from_pretrained loads it (after `import sparsekit`)" if report["from_pretrained"]
                     else "; no quantization_config: re-run `sparsekit encode` for from_pretrained"))


@handle_errors
def export_cmd(
    source: Path = typer.Argument(..., metavar="SOURCE", help="Pruned HF directory or packed TCA-BME directory."),
    output: Path = typer.Option(..., "-o", "--output", help="Output directory (compressed-tensors checkpoint)."),
    max_shard_size: str = typer.Option("2GB", "--max-shard-size", help="Largest shard file, e.g. 2GB, 500MB."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
    delete_extra: bool = DELETE_EXTRA,
    json_out: bool = JSON_OPTION,
):
    from sparsekit.packed.interchange import export_bitmask

    with _progress("exporting") as progress:
        report = export_bitmask(source, output, overwrite=overwrite, max_shard_size=max_shard_size, progress=progress,
                                delete_extra=delete_extra)
    if json_out:
        emit_json(report)
        return
    console.print(f"[bold green]exported[/] {report['compressed_weights']} sparse-bitmask weights "
                  f"(global sparsity {report['global_sparsity']:.1%}) to {report['output']}")


@handle_errors
def import_cmd(
    source: Path = typer.Argument(..., metavar="SOURCE", help="compressed-tensors checkpoint with sparsity_config format sparse-bitmask."),
    output: Path = typer.Option(..., "-o", "--output", help="Output directory (dense pruned HF checkpoint)."),
    max_shard_size: str = typer.Option("2GB", "--max-shard-size", help="Largest shard file, e.g. 2GB, 500MB."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
    delete_extra: bool = DELETE_EXTRA,
    json_out: bool = JSON_OPTION,
):
    from sparsekit.packed.interchange import import_bitmask

    with _progress("importing") as progress:
        report = import_bitmask(source, output, overwrite=overwrite, max_shard_size=max_shard_size, progress=progress,
                                delete_extra=delete_extra)
    if json_out:
        emit_json(report)
        return
    console.print(f"[bold green]imported[/] {report['decompressed_weights']} sparse-bitmask weights into {report['output']}")
