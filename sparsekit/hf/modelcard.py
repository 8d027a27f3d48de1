"""The model card (``README.md``, Hugging Face's format) that ``prune`` and ``encode`` write.

YAML front matter (``base_model`` when it is a hub id, ``tags: [sparsekit, sparse, <method>,
<pattern>]``, ``library_name: transformers``, ``pipeline_tag: text-generation``, and ``model-index``
once a perplexity is recorded), then the method, sparsity, pattern, calibration data, size and
sparsekit version, how to load it, and an evaluation section that ``sparsekit eval --ppl
--update-card`` fills (``record_perplexity``: the front matter's ``model-index`` is the record,
the section is drawn from it; the file is replaced atomically).

A card carries :data:`MARKER`. A ``README.md`` without it is the user's: it is never replaced, and
``encode`` copies it as it is instead of writing a card (``is_user_readme``).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from sparsekit.errors import SparsekitError

CARD_NAME = "README.md"
MARKER = "<!-- sparsekit model card: sparsekit rewrites it; delete this line to keep your edits -->"
EVAL_START, EVAL_END = "<!-- sparsekit:evaluation -->", "<!-- /sparsekit:evaluation -->"
# the demo alias names the GGUF of this hub model (sparsekit.hf.models)
ALIASES = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_NO_EVAL = "No evaluation recorded yet: `sparsekit eval DIR --ppl --update-card` adds the perplexity here."


def is_card(path: Path) -> bool:
    """``path/README.md`` exists and is a sparsekit card."""
    readme = Path(path) / CARD_NAME
    return readme.is_file() and MARKER in readme.read_text(encoding="utf-8", errors="replace")


def is_user_readme(path: Path) -> bool:
    """``path/README.md`` exists and is not a sparsekit card (the user's own: never replaced)."""
    return (Path(path) / CARD_NAME).is_file() and not is_card(path)


def base_model(name: str | None) -> str | None:
    """The hub id a pruning source names (``None`` for a local directory)."""
    name = ALIASES.get(str(name).lower(), str(name)) if name else None
    if name and _HUB_ID.fullmatch(name) and not Path(name).exists():
        return name
    return None


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


def _calibration(cal: dict | None) -> str:
    cal = cal or {}
    if not cal.get("nsamples"):
        return "none (the method needs no data)"
    return f"{cal['nsamples']} windows of {cal.get('seqlen')} tokens from {cal.get('dataset')} (seed {cal.get('seed')})"


def render(manifest: dict, *, packed: dict | None, size_bytes: int, front: dict | None = None) -> str:
    """The card of a pruned checkpoint (``manifest``: its sparsekit.json) or, given ``packed`` (the
    packed index's metadata), of the packed one. ``front`` keeps recorded results (``model-index``)."""
    method, pattern = str(manifest.get("method") or "unknown"), str(manifest.get("pattern") or "unknown")
    source = manifest.get("model") or manifest.get("source_model")
    cats = (manifest.get("cats") or {}).get("target")
    tags = ["sparsekit", "sparse", method, pattern] + (["cats"] if cats is not None and method != "cats" else [])
    meta: dict[str, Any] = {}
    if base_model(source):
        meta["base_model"] = base_model(source)
    meta.update({"tags": tags, "library_name": "transformers", "pipeline_tag": "text-generation"})
    if front and front.get("model-index"):
        meta["model-index"] = front["model-index"]
    sparsity = manifest.get("sparsity")
    stacked = f" + CATS {cats:.0%} activation sparsity" if cats is not None and method != "cats" else ""
    rows = [("method", method + stacked),
            ("sparsity", "-" if sparsity is None else f"{float(sparsity):.0%} of each pruned linear layer's weights"),
            ("pattern", pattern), ("calibration", _calibration(manifest.get("calibration"))),
            ("source", str(source or "-"))]
    if packed:
        dense, stored = packed.get("linear_dense_bytes"), packed.get("linear_stored_bytes")
        ratio = f" (linear weights {stored / dense:.3f}x their dense size)" if dense and stored else ""
        rows.append(("size", f"{_mb(size_bytes)} packed as TCA-BME{ratio}"))
    else:
        rows.append(("size", f"{_mb(size_bytes)} (dense weights with zeros; `sparsekit encode` packs them)"))
    version = (packed or manifest).get("sparsekit_version")
    rows.append(("sparsekit", str(version or "-")))
    title = f"{base_model(source) or Path(str(source or 'model')).name}, {method} {pattern}"
    use = (["```python", "import sparsekit  # registers the \"sparsekit\" quantizer with transformers",
            "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            "model = AutoModelForCausalLM.from_pretrained(\"PATH_OR_REPO\", device_map=\"auto\")",
            "tokenizer = AutoTokenizer.from_pretrained(\"PATH_OR_REPO\")", "```"] if packed else
           ["The weights are dense with zeros: `AutoModelForCausalLM.from_pretrained` loads them as they are"
            + (" (the CATS thresholds apply only through `sparsekit.load`)." if cats is not None or method == "cats"
               else ".")])
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", MARKER, "", f"# {title}", "",
             f"Pruned with sparsekit{' and packed as TCA-BME shards' if packed else ''}.", "",
             "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], "", "## Use it", "", *use, "",
             "## Evaluation", "", EVAL_START, _eval_section(meta.get("model-index")), EVAL_END, ""]
    return "\n".join(lines)


def _eval_section(index: list | None) -> str:
    rows = [(r.get("dataset", {}).get("name"), m.get("name"), m.get("value"))
            for entry in index or [] for r in entry.get("results", []) for m in r.get("metrics", [])]
    if not rows:
        return _NO_EVAL
    return "\n".join(["| dataset | metric | value |", "|---|---|---|",
                      *[f"| {d} | {n} | {v:.4g} |" if isinstance(v, (int, float)) else f"| {d} | {n} | {v} |"
                        for d, n, v in rows]])


def keep_user_readme(old: Path | None, new: Path) -> None:
    """An output being replaced (``--overwrite``) keeps a README of the user's: it moves into ``new``
    (the staging folder) unless ``new`` already has a README."""
    if old is not None and is_user_readme(old) and not (Path(new) / CARD_NAME).exists():
        shutil.copy2(Path(old) / CARD_NAME, Path(new) / CARD_NAME)


def write_card(directory: Path, text: str) -> bool:
    """Write ``text`` as ``directory/README.md`` (atomically) unless the user's README is there."""
    directory = Path(directory)
    if is_user_readme(directory):
        return False
    tmp = directory / f".{CARD_NAME}.tmp-{os.getpid()}"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, directory / CARD_NAME)
    return True


def read_front(directory: Path) -> dict:
    """The YAML front matter of the card in ``directory`` ({} when there is none)."""
    text = (Path(directory) / CARD_NAME).read_text(encoding="utf-8") if is_card(directory) else ""
    m = re.match(r"---\n(.*?)\n---\n", text, re.S)
    front = yaml.safe_load(m.group(1)) if m else None
    return front if isinstance(front, dict) else {}


def check_updatable(directory: Path) -> None:
    """``eval --update-card`` needs a local directory holding a sparsekit card: one error line else."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SparsekitError(f"--update-card writes the card of a local directory; {directory} is not one")
    if is_user_readme(directory):
        raise SparsekitError(f"{directory}/{CARD_NAME} is not a sparsekit model card (it lacks the marker line): "
                             "--update-card never rewrites your own README; drop --update-card")
    if not is_card(directory):
        raise SparsekitError(f"{directory} has no sparsekit model card ({CARD_NAME}) to update: it is written by "
                             "`sparsekit prune` and `sparsekit encode`; drop --update-card")


def record_perplexity(directory: Path, report: dict) -> None:
    """Put ``report`` (``sparsekit eval --ppl``'s) into the card's ``model-index`` (replacing the
    entry of the same dataset and settings) and its evaluation section; the file is replaced atomically."""
    directory = Path(directory)
    check_updatable(directory)
    text = (directory / CARD_NAME).read_text(encoding="utf-8")
    front = read_front(directory)
    dataset = str(report["dataset"])
    name = f"perplexity (seqlen {report['seqlen']}, {report['windows']} windows, {report['dtype']})"
    metric = {"type": "perplexity", "value": round(float(report["ppl"]), 4), "name": name}
    result = {"task": {"type": "text-generation"},
              "dataset": {"name": Path(dataset).name, "type": "wikitext" if "wikitext" in dataset.lower() else "text"},
              "metrics": [metric]}
    index = front.get("model-index") or [{"name": directory.name, "results": []}]
    results = [r for r in index[0].get("results", [])
               if not (r.get("dataset", {}).get("name") == result["dataset"]["name"]
                       and [m.get("name") for m in r.get("metrics", [])] == [name])]
    index[0]["results"] = results + [result]
    front["model-index"] = index
    head = "---\n" + yaml.safe_dump(front, sort_keys=False).rstrip() + "\n---\n"
    body = re.sub(r"^---\n.*?\n---\n", "", text, count=1, flags=re.S)
    section = f"{EVAL_START}\n{_eval_section(index)}\n{EVAL_END}"
    body, n = re.subn(re.escape(EVAL_START) + ".*?" + re.escape(EVAL_END), lambda _: section, body, count=1, flags=re.S)
    if not n:
        body = body.rstrip("\n") + f"\n\n## Evaluation\n\n{section}\n"
    write_card(directory, head + body)
