"""What ``sparsekit eval`` shows: the perplexity and speed tables (rich) and the speed plot (matplotlib)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from sparsekit.errors import SparsekitError


def ppl_table(report: dict):
    """The perplexity report as a rich Table (one row; with a baseline, the dense model's figure and the
    ratio beside it); a caption when the windows are too few for a stable figure."""
    from rich import box
    from rich.table import Table

    from sparsekit.evaluation.ppl import ROUGH_WINDOWS

    dataset = str(report["dataset"])
    if Path(dataset).exists():  # a local file: its name is enough in the table (--json has the full path)
        dataset = Path(dataset).name
    # what the run was on goes in the title: ten columns did not fit 80 ("seqle", "devic", "float3")
    t = Table(title=f"Perplexity of {report['model']} on {dataset} ({report['device']}, {report['dtype']})",
              box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    base = report.get("baseline")
    heads = ["seqlen", "windows", "tokens", "nll", "ppl"]
    if base:
        heads += ["dense ppl", "x dense"]
    for head in heads:
        t.add_column(head, justify="right", no_wrap=True, min_width=len(head))
    row = [str(report["seqlen"]), str(report["windows"]), f"{report['tokens']:,}", f"{report['nll']:.4f}",
           f"{report['ppl']:.3f}"]
    if base:
        row += [f"{base['ppl']:.3f}", _fmt(report.get("ratio"), ".3f")]
    t.add_row(*row)
    notes = []
    if base:
        notes.append(f"dense: {base['model']}, same {report['windows']} windows")
    if act := report.get("activation_sparsity"):
        notes.append(cats_summary(act))
    if report["windows"] < ROUGH_WINDOWS:
        notes.append(f"rough: only {report['windows']} window{'s' if report['windows'] != 1 else ''} "
                     f"(use {ROUGH_WINDOWS}+ for a stable figure)")
    if notes:
        t.caption = "\n".join(notes)
    return t


def cats_summary(act: dict) -> str:
    """One line on the CATS activation sparsity reached on the evaluation text (per MLP: --json)."""
    vals = act["mlps"]
    lo, hi = min(vals, key=vals.get), max(vals, key=vals.get)
    target = f"; target {act['target']:.4g}" if act.get("target") is not None else ""
    return (f"CATS activation sparsity on this text: mean {act['mean']:.4f} over {len(vals)} gated MLPs "
            f"(min {vals[lo]:.4f} {lo}, max {vals[hi]:.4f} {hi}{target}; per MLP in --json)")


def _pm(value, err) -> str:
    """``0.5123 ± 0.0141`` (or ``-`` when the task has no such metric)."""
    if value is None:
        return "-"
    return f"{value:.4f}" if err is None else f"{value:.4f} ± {err:.4f}"


def tasks_table(report: dict[str, Any]):
    """The task accuracy report as a rich Table: a row per task, acc and acc_norm with their stderr."""
    from rich import box
    from rich.table import Table

    shots = {row.get("num_fewshot") for row in report["tasks"]}
    kind = "Zero-shot accuracy" if shots <= {0, None} else "Task accuracy"
    t = Table(title=f"{kind} of {report['model']}", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    for head in ("task", "examples", "shots", "acc", "acc_norm"):
        t.add_column(head, justify="left" if head == "task" else "right", overflow="fold")
    for row in report["tasks"]:
        t.add_row(row.get("alias") or row["task"], _fmt(row.get("samples"), "d"), _fmt(row.get("num_fewshot"), "d"),
                  _pm(row.get("acc"), row.get("acc_stderr")), _pm(row.get("acc_norm"), row.get("acc_norm_stderr")))
    notes = [f"lm-eval {report.get('lm_eval_version') or '?'}", f"{report.get('device')}, {report.get('dtype')}"]
    if report.get("limit") is not None:
        notes.append(f"--limit {report['limit']}: first examples only, a quick look")
    t.caption = "; ".join(notes)
    return t


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _rate(x) -> str:
    """A token rate in at most six characters: 707, 5,656, 22.6k, 241k."""
    if x is None:
        return "-"
    if x < 10_000:
        return f"{x:,.0f}"
    return f"{x / 1000:.1f}k" if x < 100_000 else f"{x / 1000:.0f}k"


def speed_table(report: dict[str, Any]):
    """The report as a rich Table that fits 80 columns: tokens/s packed, dense and their ratio for
    decode and prefill, and peak memory; the caption says how the ratios were measured; ``--json``
    has the rest (ms per token, each paired round's ratio, per-shape timings)."""
    from rich import box
    from rich.table import Table

    title = (f"Speed on {report.get('gpu', '?')} ({report.get('dtype', '?')}, prompt {report.get('prompt_len')}, "
             f"{report.get('new_tokens')} new tokens, CUDA graphs {'on' if report.get('cuda_graphs') else 'off'})")
    t = Table(title=title, box=box.SIMPLE_HEAD)
    for head in ("batch", "decode\npacked", "tok/s\ndense", "\nx", "prefill\npacked", "tok/s\ndense", "\nx",
                 "peak GiB\npacked", "\ndense"):
        t.add_column(head, justify="right")
    for row in report["rows"]:
        p, d, r = row["packed"], row["dense"], row.get("ratio", {})
        t.add_row(str(row["batch_size"]),
                  _rate(p.get("decode_tok_s")), _rate(d.get("decode_tok_s")), _fmt(r.get("decode_tok_s"), ".2f"),
                  _rate(p.get("prefill_tok_s")), _rate(d.get("prefill_tok_s")), _fmt(r.get("prefill_tok_s"), ".2f"),
                  _fmt(p.get("peak_mem_gib"), ".2f"), _fmt(d.get("peak_mem_gib"), ".2f"))
    w = report.get("weights_gib") or {}
    plan = report.get("dispatch") or {}
    lines = []
    if report.get("measurement") == "interleaved":
        counts = sorted(len(r["paired"].get("prefill_x", [])) for r in report["rows"] if r.get("paired"))
        pairs = (f"{counts[0]}" if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}") if counts else \
            (report.get('prefill_rounds') or 0) * (report.get('prefill_runs') or 0)
        lines.append(f"x: packed/dense, median of {pairs} prefill pairs and {report.get('repeats')} "
                     "decode rounds, interleaved")
    elif report.get("measurement") == "sequential":
        lines.append("x: packed/dense, each alone, one model after the other (see the warning)")
    if w:
        copies = plan.get("dense_copy_bytes", 0) / 2**30
        caption = (f"weights: packed {w.get('packed', 0):.3f} GiB"
                   + (f" (of which {copies:.3f} dense copies)" if copies else "")
                   + f", dense {w.get('dense', 0):.3f} GiB")
        if plan.get("groups"):
            dense_layers = len(plan.get("dense_layers", {}))
            caption += (f"; prefer {plan.get('prefer')}: {dense_layers} of {report.get('sparse_layers', 0)} sparse layers "
                        "run dense (--json: per-shape timings)")
        if report.get("cats_mlps"):
            caption += (f"; CATS: {report.get('cats_kernel_mlps', 0)} of {report['cats_mlps']} thresholded MLPs on the "
                        "CATS kernel (dense: no thresholds)")
        lines.append(caption)
    if lines:
        t.caption = "\n".join(lines)
    return t


def plot_speed(report: dict[str, Any], path) -> Path:
    """PNG of decode and prefill tokens/s against batch size, packed vs dense."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SparsekitError("plotting needs matplotlib: pip install sparsekit[plot]")
    path = Path(path)
    if not path.parent.exists():
        raise SparsekitError(f"cannot write {path}: the folder {path.parent} does not exist")
    rows = report["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "decode_tok_s", "decode"), (axes[1], "prefill_tok_s", "prefill")):
        for which, style in (("packed", "o-"), ("dense", "s--")):
            pts = [(r["batch_size"], r[which][key]) for r in rows if r[which].get(key) is not None]
            if pts:
                ax.plot([b for b, _ in pts], [v for _, v in pts], style, label=which)
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["batch_size"] for r in rows], [str(r["batch_size"]) for r in rows])
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{label} tokens/s")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{Path(str(report.get('model', ''))).name} on {report.get('gpu', '?')}")
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def host_memory_text(report: dict) -> str:
    """The prune summary's host line: where the weights lived and the peak host RSS."""
    where = "streamed from disk layer by layer" if report.get("offload") == "disk" else "loaded in host memory"
    peak = report.get("peak_host_bytes")
    return f"peak host memory (RSS) {'-' if peak is None else f'{peak / 2**20:,.0f} MiB'}, weights {where}"
