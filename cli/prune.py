"""sparsekit prune: a thin typer layer over ``sparsekit.pruning.api.prune``."""
from __future__ import annotations

from typing import List, Optional

import typer

from sparsekit.cli.common import JSON_OPTION, console, emit_json, err_console, handle_errors
from sparsekit.cli.render import host_memory_text
from sparsekit.errors import SparsekitError

HELP = (
    "Prune a causal LM layer by layer and write an HF checkpoint (dense weights with zeros).\n\n"
    "Methods: magnitude, wanda, sparsegpt, admm, cats. Patterns: unstructured (with --sparsity), N:M (2:4, 4:8, ...), "
    "hybrid[:T] (TxT tiles, each dense or 2:4). Settings come from the defaults, then --recipe, then the "
    "flags you pass.\n\n"
    "Recipes: --recipe takes the name of a bundled recipe (list them with `sparsekit recipes`, e.g. wanda-2of4) "
    "from any folder, or a YAML file path (an existing file wins over a bundled name).\n\n"
    "cats (gated MLPs: Llama, Mistral, Qwen2, SmolLM2) changes no weight: it calibrates one threshold per MLP "
    "and zeroes the gate activations act(gate(x)) smaller in magnitude, --sparsity being the fraction zeroed "
    "(unstructured only); the thresholds go into sparsekit.json, and `sparsekit eval` applies them.\n\n"
    "--cats S stacks both on a weight method (any pattern): the weights are pruned first, then the CATS "
    "thresholds (activation sparsity S) are calibrated layer by layer on the pruned model; sparsekit.json "
    "records both, and `encode` keeps both.\n\n"
    "--learn-mask (hybrid or 2:4) learns the mask instead, weights frozen: logits per tile (dense or 2:4) and "
    "per group of 4 (which 2 to keep), started from the method's one-shot choice and trained for --steps on "
    "the calibration text; --allocation global ranks the hybrid tiles of the whole model at once.\n\n"
    "--allocation owl (unstructured, hybrid) gives each decoder layer its own sparsity from its share of outlier "
    "activations (OWL; --owl-lambda, --owl-m), keeping --sparsity as the global one. --refine dsnot swaps pruned "
    "and kept weights where that lowers a layer's reconstruction error; --update admm recomputes the kept weights "
    "on the final mask with ADMM (--admm-iters); --method admm chooses the mask during ADMM itself.\n\n"
    "Example: sparsekit prune smollm2-135m --method wanda --sparsity 0.5 -o out/wanda50\n\n"
    "Example: sparsekit prune smollm2-135m --method wanda --sparsity 0.7 --allocation owl --update admm\n\n"
    "Example: sparsekit prune smollm2-135m --method sparsegpt --pattern hybrid --sparsity 0.35 --learn-mask"
)


# the defaults of sparsekit.pruning.patterns, written out (importing it would load torch for --help);
# tests/test_cli_prune.py checks that they agree
SPARSITY_HELP = ("Fraction of weights (cats: of gate activations) to zero in [0, 1) (default: 0.5; "
                 "hybrid 0.25, half the tiles 2:4; implied by N:M)")


def register(app: typer.Typer) -> None:
    app.command("prune", help=HELP)(prune_cmd)


@handle_errors
def prune_cmd(
    model: str = typer.Argument("smollm2-135m", metavar="MODEL", help="Local HF directory, hub id, or the demo alias smollm2-135m."),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="magnitude | wanda | sparsegpt | admm | cats (default: wanda)"),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", "-s", help=SPARSITY_HELP),
    pattern: Optional[str] = typer.Option(None, "--pattern", "-p", help="unstructured | N:M (2:4, 4:8) | hybrid[:T] (default: unstructured)"),
    calib: Optional[str] = typer.Option(None, "--calib", "--dataset", help="Calibration text: wikitext2, c4, a hub dataset, or a .txt/.jsonl/.parquet file (default: wikitext2)"),
    nsamples: Optional[int] = typer.Option(None, "--nsamples", help="Calibration windows (default: 128)"),
    seqlen: Optional[int] = typer.Option(None, "--seqlen", help="Tokens per window, capped at the model context (default: 2048)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for drawing the windows and the CATS activation sample (default: 0)"),
    skip: Optional[List[str]] = typer.Option(None, "--skip", metavar="PATTERN", help="Module-name pattern (fnmatch) to leave dense; repeatable; lm_head is always left dense"),
    prune_lm_head: bool = typer.Option(False, "--prune-lm-head", help="Prune lm_head too (magnitude only; refused when it is tied to the embeddings)."),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-r", help="Bundled recipe name (see `sparsekit recipes`, e.g. wanda-2of4) or a YAML file; flags override it."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Output directory (default: out/<model>-<method>-<pattern>)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    delete_extra: bool = typer.Option(False, "--delete-extra", help="With --overwrite: also delete files in the old output that sparsekit did not write (refused otherwise)."),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu: where each layer is pruned (the rest of the model stays in host memory, or on disk with --offload disk)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (fp16 on CUDA, fp32 on CPU) | float16 | bfloat16 | float32"),
    blocksize: Optional[int] = typer.Option(None, "--blocksize", help="SparseGPT column block size (default: 128)"),
    damp: Optional[float] = typer.Option(None, "--damp", help="SparseGPT dampening, fraction of the mean Hessian diagonal (default: 0.01)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Calibration windows per forward (default: ~16k tokens)"),
    cats: Optional[float] = typer.Option(None, "--cats", help="Also calibrate CATS thresholds zeroing this fraction of the gate "
                                         "activations of each gated MLP, on the pruned model (a weight method only)."),
    offload: str = typer.Option("auto", "--offload", help="auto | memory | disk: disk streams a safetensors checkpoint from disk layer by layer and writes each pruned layer at once (host memory: a few layers); auto streams when the model would not fit comfortably in free host memory."),
    allocation: Optional[str] = typer.Option(None, "--allocation", help="layer (every linear at --sparsity) | global (hybrid tiles: one ranking over the model; sensitive linears stay denser) | owl (unstructured / hybrid: each decoder layer's sparsity from its share of outliers, OWL; --sparsity stays the global target) (default: layer)"),
    owl_lambda: Optional[float] = typer.Option(None, "--owl-lambda", help="--allocation owl: spread, each layer within --sparsity +- lambda (default: 0.08, the paper's)"),
    owl_m: Optional[float] = typer.Option(None, "--owl-m", help="--allocation owl: outlier threshold M, in multiples of the layer's mean Wanda score (default: 5, the paper's)"),
    owl_windows: Optional[int] = typer.Option(None, "--owl-windows", help="--allocation owl: calibration windows of the outlier scan of the dense model (default: 16)"),
    update: Optional[str] = typer.Option(None, "--update", help="admm: recompute the kept weights on the method's final mask with ADMM on the layer's least-squares problem (any pattern; gathers the Hessian)"),
    admm_iters: Optional[int] = typer.Option(None, "--admm-iters", help="--update admm / --method admm: ADMM iterations (default: 20)"),
    refine: Optional[str] = typer.Option(None, "--refine", help="dsnot: refine the method's mask by swapping pruned and kept weights of a row (N:M group, 2:4 tile) where that lowers the layer's reconstruction error"),
    dsnot_cycles: Optional[int] = typer.Option(None, "--dsnot-cycles", help="--refine dsnot: at most this many swaps per row (default: 50)"),
    learn_mask: bool = typer.Option(False, "--learn-mask", help="Learn the hybrid / 2:4 mask on the calibration text, weights frozen (see sparsekit.pruning.learn)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="--learn-mask: optimizer steps (default: 150)"),
    lr: Optional[float] = typer.Option(None, "--lr", help="--learn-mask: Adam learning rate on the mask logits (default: 0.05)"),
    learn_batch: Optional[int] = typer.Option(None, "--learn-batch", help="--learn-mask: calibration windows per step (default: 8)"),
    holdout: Optional[float] = typer.Option(None, "--holdout", help="--learn-mask: fraction of the calibration windows held out to keep the best mask (default: 0.125; 0: keep the last)"),
    distill: bool = typer.Option(False, "--distill", help="--learn-mask: minimize the KL divergence from the dense model's next-token distribution instead of the LM loss"),
    weight_update: bool = typer.Option(False, "--weight-update", help="--learn-mask / --allocation global: recompute the kept weights from the dense ones with SparseGPT's update on the final mask (default: off; learning keeps the one-shot weights frozen)"),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="--learn-mask: save the learning state every K steps (0: never)"),
    checkpoint_dir: Optional[str] = typer.Option(None, "--checkpoint-dir", help="--learn-mask: where checkpoints go (default: OUTPUT-checkpoints)"),
    resume: bool = typer.Option(False, "--resume", help="--learn-mask: continue from the latest checkpoint (same settings and --seed)"),
    json_out: bool = JSON_OPTION,
) -> None:
    from transformers.utils import logging as hf_logging

    from sparsekit.pruning.api import prune

    hf_logging.disable_progress_bar()  # our own bars only
    bars = _Bars(disable=False)

    def warn(msg: str) -> None:
        err_console.print(f"[yellow]warning:[/] {msg}", highlight=False, soft_wrap=True)

    learn = None
    if learn_mask:
        given = dict(steps=steps, lr=lr, batch_size=learn_batch, holdout=holdout)
        learn = dict({k: v for k, v in given.items() if v is not None}, distill=distill, weight_update=weight_update,
                     checkpoint_every=checkpoint_every, checkpoint_dir=checkpoint_dir, resume=resume)
    elif resume or checkpoint_every or distill or any(v is not None for v in (steps, lr, learn_batch, holdout)):
        raise SparsekitError("--steps, --lr, --learn-batch, --holdout, --distill, --checkpoint-every and --resume "
                             "go with --learn-mask")
    elif weight_update and allocation != "global":
        raise SparsekitError("--weight-update goes with --learn-mask or --allocation global")
    elif weight_update:
        learn = dict(steps=0, weight_update=True)
    with bars:
        report = prune(
            model, method=method, sparsity=sparsity, pattern=pattern, calib=calib, nsamples=nsamples,
            seqlen=seqlen, seed=seed, skip=skip, prune_lm_head=prune_lm_head or None, device=device, dtype=dtype, output=output,
            overwrite=overwrite, blocksize=blocksize, damp=damp, recipe=recipe, batch_size=batch_size,
            allocation=allocation, learn=learn, progress=bars.update, warn=warn, cats=cats, offload=offload,
            delete_extra=delete_extra,
            owl_lambda=owl_lambda, owl_m=owl_m, owl_windows=owl_windows, update=update, admm_iters=admm_iters,
            refine=refine, dsnot_cycles=dsnot_cycles,
        )
    if json_out:
        emit_json(report)
        return
    console.print(summary_table(report))
    err_console.print(f"[green]wrote[/] {report['output']}")


class _Bars:
    """rich progress bars on stderr, one per stage ("calibration", "layers"), created on first use."""

    LABELS = {"calibration": "capturing calibration inputs", "layers": "pruning decoder layers",
              "outliers": "measuring outliers (OWL)",
              "thresholds": "calibrating CATS thresholds", "scores": "scoring (dense model)",
              "learning": "learning masks", "final": "final weights on the learned mask"}

    def __init__(self, disable: bool = False):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=err_console, disable=disable, transient=False)
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def update(self, stage: str, done: int, total: int, item: str = "") -> None:
        """A ``sparsekit.progress.Progress``: one bar per stage (``item`` is not shown)."""
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(self.LABELS.get(stage, stage), total=total)
        self.progress.update(self.tasks[stage], completed=done, total=total)


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def summary_table(report: dict):
    from rich.console import Group
    from rich.table import Table

    head = Table.grid(padding=(0, 2))
    head.add_row("model", str(report["model"]))
    head.add_row("method / pattern", f"{report['method']} / {report['pattern']} (target sparsity {report['sparsity']:.4g})")
    cal = report["calibration"]
    if cal.get("nsamples"):
        head.add_row("calibration", f"{cal['dataset']}: {cal['nsamples']} x {cal['seqlen']} tokens, seed {cal['seed']}")
    # the figures first: a line that wraps at 80 columns then breaks in the words, not in "1,381 MiB"
    head.add_row("device", f"{report['device']}, peak device memory {_mib(report['peak_mem_bytes'])} "
                 f"({report['dtype']} compute, saved as {report['saved_dtype']})")
    head.add_row("host", host_memory_text(report))
    head.add_row("time", f"{report['elapsed_s']:.1f} s total, {report['prune_seconds']:.1f} s pruning "
                 f"({report['capture_seconds']:.1f} s capture)")
    stacked = bool(report.get("cats")) and report["method"] != "cats"
    if report.get("cats"):
        c = report["cats"]
        head.add_row("activation sparsity", f"{c['activation_sparsity']:.4f} of the gate activations of "
                     f"{len(c['mlps'])} gated MLPs (target {c['target']:.4g})"
                     + ("; thresholds calibrated on the pruned weights" if stacked else "; weights unchanged"))
    if not report.get("cats") or stacked:
        head.add_row("overall sparsity", f"{report['overall_sparsity']:.4f} of {sum(v['params'] for v in report['by_type'].values()):,} pruned-layer weights")
    if report.get("learning"):
        lr_ = report["learning"]
        cl = lr_["calibration_loss"]
        loss = f", calibration loss {cl['init']:.4f} (one-shot) -> {cl['learned_mask']:.4f}" if cl.get("init") is not None else ""
        head.add_row("mask", f"{lr_['allocation']} allocation, {lr_['steps']} learning steps from {lr_['init']} scores "
                     f"({lr_['learn_seconds']:.1f} s){loss}{', SparseGPT update' if lr_['weight_update'] else ''}")
    if report.get("allocation"):
        a = report["allocation"]
        t = a["target"]
        head.add_row("allocation", f"OWL (lambda {a['lambda']:g}, M {a['m']:g}): layer targets {min(t):.4f} to "
                     f"{max(t):.4f}, outlier ratios {min(a['outlier_ratio']):.3g}% to {max(a['outlier_ratio']):.3g}%")
    steps = [f"{k} {report[k]['kind']}" for k in ("refine", "update") if report.get(k)]
    if steps:
        head.add_row("steps", ", then ".join(steps))
    head.add_row("output", report["output"])
    if report.get("cats") and not stacked:
        return Group(head, cats_table(report["cats"]))

    types = Table(title="sparsity by module type", title_justify="left")
    types.add_column("module")
    types.add_column("sparsity", justify="right")
    types.add_column("weights", justify="right")
    for name, v in report["by_type"].items():
        types.add_row(name, f"{v['sparsity']:.4f}", f"{v['params']:,}")

    layers = Table(title="per decoder layer", title_justify="left")
    layers.add_column("layer", justify="right")
    layers.add_column("linears", justify="right")
    layers.add_column("sparsity", justify="right")
    owl = bool(report.get("allocation"))
    if owl:
        layers.add_column("target", justify="right")
    layers.add_column("time", justify="right")
    layers.add_column("peak mem", justify="right")
    for r in report["per_layer"]:
        lin = [report["layers"][n] for n in r["linears"]]
        tot = sum(x["shape"][0] * x["shape"][1] for x in lin)
        sp = sum(x["sparsity"] * x["shape"][0] * x["shape"][1] for x in lin) / tot if tot else 0.0
        target = [f"{r['target']:.4f}"] if owl else []
        layers.add_row(str(r["index"]), str(len(lin)), f"{sp:.4f}", *target, f"{r['seconds']:.2f} s", _mib(r["peak_mem_bytes"]))
    return Group(head, types, layers, *([cats_table(report["cats"])] if stacked else []))


def cats_table(cats: dict):
    from rich.table import Table

    table = Table(title="CATS thresholds per gated MLP", title_justify="left")
    table.add_column("MLP")
    table.add_column("threshold", justify="right")
    table.add_column("activation sparsity", justify="right")
    table.add_column("sample", justify="right")
    for name, r in cats["mlps"].items():
        table.add_row(name, f"{r['threshold']:.5g}", f"{r['activation_sparsity']:.4f}",
                      f"all {r['samples']:,}" if r["exact"] else f"{r['samples']:,}")
    return table
