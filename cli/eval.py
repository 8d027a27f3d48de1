"""sparsekit eval: perplexity (WikiText-2 protocol) and speed of a pruned, packed or dense model."""
from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape

from sparsekit.cli import render
from sparsekit.cli.common import (JSON_OPTION, console, emit_json, ends_at_once, err_console, handle_errors,
                                  progress_bar)

HELP = (
    "Evaluate a model: perplexity (--ppl, the default), zero-shot task accuracy through lm-evaluation-harness "
    "(--tasks, the optional `sparsekit\\[tasks]` extra) and/or decode/prefill speed against its dense "
    "counterpart (--speed, CUDA only).\n\n"
    "DIR is a pruned HF directory (from `sparsekit prune`), a packed TCA-BME directory (from "
    "`sparsekit encode`), a hub id, or the demo alias smollm2-135m.\n\n"
    "Perplexity follows the Wanda/SparseGPT WikiText-2 protocol: the test split joined with blank lines, "
    "tokenized once, non-overlapping --seqlen windows, leftover tokens dropped, ppl = exp(mean NLL). --baseline scores the dense model DIR was pruned from on the same windows.\n\n"
    "Examples: sparsekit eval out/wanda50 --ppl --max-windows 8 --baseline; "
    "sparsekit eval out/wanda50 --tasks arc_easy,hellaswag --limit 200"
)


def register(app: typer.Typer) -> None:
    app.command("eval", help=HELP)(eval_cmd)


def _batch_sizes(text: str) -> tuple[int, ...]:
    from sparsekit.errors import SparsekitError

    try:
        sizes = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise SparsekitError(f"--batch-sizes {text!r} is not a list of positive integers: write e.g. 1,8,16,32")
    return sizes


@handle_errors
def eval_cmd(
    model_dir: str = typer.Argument("smollm2-135m", metavar="DIR",
                                    help="Pruned or packed directory, hub id, or the demo alias smollm2-135m."),
    ppl: bool = typer.Option(False, "--ppl", help="Measure perplexity (the default when neither --ppl nor --speed is given)."),
    speed: bool = typer.Option(False, "--speed", help="Measure prefill/decode speed, packed vs dense (CUDA GPU)."),
    dataset: str = typer.Option("wikitext2", "--dataset", help="wikitext2 (hub test split) or a .txt/.jsonl/.parquet FILE."),
    seqlen: int = typer.Option(2048, "--seqlen", help="Tokens per perplexity window, capped at the model context."),
    max_windows: Optional[int] = typer.Option(None, "--max-windows", help="Evaluate at most this many windows (default: all)."),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (float16 on CUDA, float32 on CPU) | float16 | bfloat16 | float32"),
    batch_sizes: str = typer.Option("1,8,16,32", "--batch-sizes", help="Batch sizes for --speed, comma-separated."),
    plot: Optional[str] = typer.Option(None, "--plot", help="With --speed: write a PNG of tokens/s against batch size."),
    prefer: str = typer.Option("speed", "--prefer", help="With --speed: speed (layers run in their fastest form, measured at load; "
                               "keeps dense copies where dense wins) | memory (packed weights only)."),
    baseline: bool = typer.Option(False, "--baseline", help="With --ppl: also score the dense model DIR was pruned from "
                                  "(recorded in its sparsekit.json) on the same windows, and their ratio."),
    baseline_model: Optional[str] = typer.Option(None, "--baseline-model", metavar="DIR",
                                                 help="The dense model for --baseline (directory, hub id or alias), "
                                                 "when DIR does not record it or it moved. Implies --baseline."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="lm-eval tasks, comma-separated, e.g. arc_easy,hellaswag "
                                        "(needs pip install \"sparsekit\\[tasks]\"; datasets download from the hub)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="With --tasks: score only the first N examples of each task."),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", help="With --tasks: few-shot examples (default: "
                                              "each task's own, 0 for the usual zero-shot tasks)."),
    include_path: Optional[str] = typer.Option(None, "--include-path", metavar="DIR",
                                               help="With --tasks: a folder of task YAML files of your own (lm-eval format)."),
    update_card: bool = typer.Option(False, "--update-card", help="With --ppl: record the perplexity in DIR's model card "
                                     "(the README.md that prune and encode write), replacing it atomically."),
    json_out: bool = JSON_OPTION,
) -> None:
    from transformers.utils import logging as hf_logging

    from sparsekit.errors import SparsekitError

    hf_logging.disable_progress_bar()  # our own bars only
    hf_logging.set_verbosity_error()
    baseline = baseline or baseline_model is not None
    if baseline and not ppl and (speed or tasks):
        raise SparsekitError("--baseline puts the dense model's perplexity beside this one: add --ppl")
    if not ppl and not speed and not tasks:
        ppl = True
    if not tasks and (limit is not None or num_fewshot is not None or include_path is not None):
        raise SparsekitError("--limit, --num-fewshot and --include-path apply to --tasks: add --tasks NAMES")
    if limit is not None and limit < 1:
        raise SparsekitError(f"--limit must be >= 1, got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise SparsekitError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    task_names, manager = None, None
    if tasks:  # lm-eval present, task names known: checked before any model is loaded
        from sparsekit.evaluation.tasks import check_tasks, parse_tasks, task_manager

        task_names = parse_tasks(tasks)
        manager = task_manager(include_path)
        check_tasks(manager, task_names)
    if update_card:  # before any work: a local directory with a sparsekit card, never a README of the user's
        from pathlib import Path

        from sparsekit.hf.modelcard import check_updatable

        if not ppl:
            raise SparsekitError("--update-card records the perplexity in the model card: add --ppl")
        check_updatable(Path(model_dir))
    if plot and not speed:
        raise SparsekitError("--plot draws the speed measurement: add --speed")
    sizes = _batch_sizes(batch_sizes)
    from sparsekit.runtime.dispatch import PREFER

    if prefer not in PREFER:
        raise SparsekitError(f"--prefer {prefer!r} is not one of speed, memory")
    if speed:  # fail before a long perplexity run, not after it
        import torch
        from pathlib import Path

        if device == "cpu" or not torch.cuda.is_available():
            raise SparsekitError("--speed measures the CUDA kernels and needs a CUDA GPU: run it on a GPU machine or drop --speed")
        if plot and not Path(plot).expanduser().resolve().parent.is_dir():
            raise SparsekitError(f"cannot write --plot {plot}: its folder does not exist")

    def warn(msg: str) -> None:
        err_console.print(f"[yellow]warning:[/] {escape(msg)}", highlight=False, soft_wrap=True)

    report: dict = {"model": model_dir}
    if ppl:
        from sparsekit.evaluation.ppl import perplexity_report

        with progress_bar() as bars:
            report["ppl"] = perplexity_report(model_dir, dataset=dataset, seqlen=seqlen, max_windows=max_windows,
                                              device=device, dtype=dtype, progress=bars, warn=warn,
                                              baseline=baseline, baseline_model=baseline_model)
        if update_card:
            from sparsekit.hf.modelcard import record_perplexity

            record_perplexity(Path(model_dir), report["ppl"])
        if not json_out:
            console.print(render.ppl_table(report["ppl"]))
    if task_names:
        from sparsekit.evaluation.tasks import tasks_report

        report["tasks"] = tasks_report(model_dir, tasks=task_names, limit=limit, num_fewshot=num_fewshot, device=device,
                                       dtype=dtype, manager=manager, warn=warn)
        if not json_out:
            console.print(render.tasks_table(report["tasks"]))
    if speed:
        from sparsekit.evaluation.speed import measure_speed
        from sparsekit.hf.models import local_model_dir, resolve_dtype

        location = local_model_dir(model_dir)  # a hub id: the speed runner reads a local directory
        dev = "cuda" if device == "auto" else device
        with progress_bar() as bars:
            report["speed"] = measure_speed(location, device=dev, batch_sizes=sizes,
                                            dtype=resolve_dtype(None if dtype == "auto" else dtype, "cuda"), prefer=prefer,
                                            progress=bars)
        for note in report["speed"].get("notes", []):
            warn(note)
        if plot:
            report["speed"]["plot"] = str(render.plot_speed(report["speed"], plot))
        if not json_out:
            console.print(render.speed_table(report["speed"]))
            if plot:
                err_console.print(f"[green]wrote[/] {report['speed']['plot']}")
    if json_out:
        emit_json(_finite_or_null(report))
    ends_at_once()   # the console script ends without tearing down the models and compiled graphs one by one


def _finite_or_null(obj):
    """inf/nan (an overflowed perplexity) become null: JSON has no Infinity, and jq and friends reject it."""
    import math

    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_null(v) for v in obj]
    return obj
