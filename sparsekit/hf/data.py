"""Calibration windows and evaluation text.

Sources (``source`` argument / ``--calib`` / ``--dataset``):
  * a local file: ``.txt`` (non-blank lines joined with a blank line, ``"\\n\\n"``), ``.jsonl``
    (the ``"text"`` field of each row) or ``.parquet`` (its ``text`` column, through ``datasets``);
  * ``wikitext2``: Hugging Face ``Salesforce/wikitext``, config ``wikitext-2-raw-v1``;
  * ``c4``: ``allenai/c4`` (English), sampled as in the Wanda/SparseGPT code: random documents
    longer than ``seqlen`` tokens, then one random window from each;
  * any hub dataset as ``name[:config[:split]]`` with a ``text`` column.

Calibration text is tokenized once; ``nsamples`` windows of ``seqlen`` tokens start at random
offsets drawn from a ``torch.Generator`` seeded with ``seed``, so the windows depend on the seed only.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from sparsekit.errors import SparsekitError

WIKITEXT2 = ("Salesforce/wikitext", "wikitext-2-raw-v1")
C4 = ("allenai/c4", "en/c4-train.00000-of-01024.json.gz")  # the shard the Wanda/SparseGPT code samples
# The shortest window a user may ask for, in prune (calibration) and eval (perplexity) alike.
MIN_SEQLEN = 8
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")


# ----------------------------------------------------------------------------- reading text
def _read_text(path: Path) -> str:
    """A local file's text, with one-line errors for unreadable or non-UTF-8 files."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SparsekitError(f"{path} is not UTF-8 text (byte {e.start}): pass a UTF-8 .txt/.jsonl file") from None
    except OSError as e:
        raise SparsekitError(f"cannot read {path} ({e.strerror or type(e).__name__}): check the file and its permissions") from None


def _rows_from_file(path: Path) -> list[str]:
    """The text rows of a local file (a .txt file's rows are its lines)."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _read_text(path).splitlines()
    if suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(_read_text(path).split("\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SparsekitError(f"{path}:{lineno} is not valid JSON ({e.msg}): each line must be a JSON object") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise SparsekitError(f"{path}:{lineno} has no string \"text\" field: write one {{\"text\": ...}} per line")
            rows.append(row["text"])
        return rows
    if suffix == ".parquet":
        ds = _load_dataset("parquet", data_files=str(path), split="train")
        return _text_column(ds, str(path))
    raise SparsekitError(f"unsupported file type {path.name}: use a .txt, .jsonl or .parquet file, or wikitext2 / c4")


def _load_dataset(*args, **kwargs):
    try:
        import datasets
    except ImportError:  # pragma: no cover - a declared dependency
        raise SparsekitError("the `datasets` package is missing: pip install datasets") from None
    what = " ".join(str(a) for a in args if a)
    offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
    if args and args[0] not in ("parquet", "json", "text", "csv") and not offline:
        _probe_hub(args[0], what)
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # we report failures in one line ourselves
    try:
        return datasets.load_dataset(*args, **kwargs)
    except Exception as e:
        if offline:
            hint = "you are offline (HF_HUB_OFFLINE=1): "
        elif isinstance(e, (ConnectionError, OSError)) or "reach" in str(e):
            hint = "offline or the hub cannot be reached: "
        else:
            hint = ""
        raise SparsekitError(
            f"could not load dataset {what!r} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}): "
            f"{hint}pass a local .txt/.jsonl/.parquet file instead"
        ) from None
    finally:
        datasets.logging.set_verbosity(level)


def _probe_hub(repo_id: str, what: str) -> None:
    """Fail fast when the hub cannot be reached (``load_dataset`` would retry for ~20 s first)."""
    try:
        from huggingface_hub import dataset_info

        dataset_info(repo_id, timeout=10)
    except Exception as e:
        name = type(e).__name__
        if "NotFound" in name or "Gated" in name or "HTTPError" in name:
            return  # reachable: let load_dataset report the details
        raise SparsekitError(
            f"could not load dataset {what!r}: offline or the Hugging Face hub cannot be reached ({name}): "
            "pass a local .txt/.jsonl/.parquet file instead, or set HF_HUB_OFFLINE=1 to use a cached copy"
        ) from None


def _text_column(ds, name: str) -> list[str]:
    if "text" not in ds.column_names:
        raise SparsekitError(f"dataset {name} has no 'text' column (columns: {', '.join(ds.column_names)})")
    return list(ds["text"])


def _hub_rows(source: str, split: str) -> list[str]:
    """Rows of a hub dataset given as an alias or ``name[:config[:split]]``."""
    if source == "wikitext2":
        return _text_column(_load_dataset(*WIKITEXT2, split=split), f"wikitext2 {split}")
    name, _, rest = source.partition(":")
    config, _, split_ = rest.partition(":")
    ds = _load_dataset(name, config or None, split=split_ or split)
    return _text_column(ds, source)


def _is_local(source: str) -> bool:
    return Path(source).expanduser().exists() or Path(source).suffix.lower() in LOCAL_SUFFIXES


def _local_path(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        raise SparsekitError(f"{source} is a directory: pass one .txt/.jsonl/.parquet file, or wikitext2 / c4")
    if not path.is_file():
        raise SparsekitError(f"no file at {source}: pass an existing .txt/.jsonl/.parquet file, or wikitext2 / c4")
    return path


def check_source(source: str) -> None:
    """A source naming a local file must name an existing one: checked before any model loads."""
    if _is_local(str(source)):
        _local_path(str(source))


def calibration_text(source: str) -> str:
    """The whole calibration text of a non-c4 source, rows joined with ``"\\n\\n"`` (blank rows dropped)."""
    if _is_local(source):
        rows = _rows_from_file(_local_path(source))
    else:
        rows = _hub_rows(source, "train")
    return "\n\n".join(r.strip("\n") for r in rows if r.strip())


def eval_text(source: str = "wikitext2") -> str:
    """Evaluation text: ``wikitext2`` -> the hub test split's rows joined with ``"\\n\\n"`` (the exact
    string the Wanda/SparseGPT code tokenizes); a .txt file verbatim; a .jsonl/.parquet file's rows
    joined with ``"\\n\\n"``; ``name[:config[:split]]`` -> that split's rows (default split test)."""
    if _is_local(source):
        path = _local_path(source)
        if path.suffix.lower() == ".txt":
            return _read_text(path)
        return "\n\n".join(_rows_from_file(path))
    if source == "c4":
        raise SparsekitError("c4 is a calibration source here: evaluate on wikitext2 or a local file")
    return "\n\n".join(_hub_rows(source, "test"))


# ----------------------------------------------------------------------------- windows
def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of the whole text as one 1-D LongTensor (no length warnings: we window it ourselves)."""
    ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids
    return ids[0].long()


def check_seqlen(seqlen) -> int:
    """A requested window length as an int, at least ``MIN_SEQLEN`` (the one check of prune and eval)."""
    try:
        n = int(seqlen)
        if isinstance(seqlen, bool) or (isinstance(seqlen, float) and n != seqlen):
            raise ValueError
    except (TypeError, ValueError):
        raise SparsekitError(f"seqlen must be an integer, got {seqlen!r}") from None
    if n < MIN_SEQLEN:
        raise SparsekitError(f"seqlen must be at least {MIN_SEQLEN}, got {n}")
    return n


def cap_seqlen(model, seqlen: int) -> int:
    """``seqlen`` (at least ``MIN_SEQLEN``) capped at the model's context length (``max_position_embeddings`` or alike)."""
    from sparsekit.hf.models import model_context

    seqlen = check_seqlen(seqlen)
    ctx = model_context(model)
    return min(seqlen, ctx) if ctx else seqlen


def _check_request(nsamples: int, seqlen: int) -> None:
    if nsamples < 1:
        raise SparsekitError(f"nsamples must be >= 1, got {nsamples}")
    if seqlen < 1:
        raise SparsekitError(f"seqlen must be >= 1, got {seqlen}")


def sample_windows(ids: torch.Tensor, nsamples: int, seqlen: int, seed: int = 0, source: str = "text") -> torch.Tensor:
    """``nsamples`` windows of ``seqlen`` consecutive tokens at seeded random offsets of ``ids``."""
    _check_request(nsamples, seqlen)
    n = ids.numel()
    if n < seqlen:
        raise SparsekitError(
            f"calibration text {source} has only {n} tokens, fewer than one window of seqlen={seqlen}: "
            "use a longer text or a smaller --seqlen"
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - seqlen + 1, (nsamples,), generator=gen)
    offsets = starts[:, None] + torch.arange(seqlen)[None, :]
    return ids[offsets]


def _c4_windows(tokenizer, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """Wanda/SparseGPT-style C4 sampling: random documents longer than seqlen, one random window each."""
    docs = _load_dataset(C4[0], data_files={"train": C4[1]}, split="train")
    gen = torch.Generator().manual_seed(seed)
    windows, tries = [], 0
    while len(windows) < nsamples:
        tries += 1
        if tries > 100 * nsamples:
            raise SparsekitError(f"c4 has too few documents longer than seqlen={seqlen} tokens: use a smaller --seqlen")
        doc = docs[int(torch.randint(0, len(docs), (1,), generator=gen))]["text"]
        ids = tokenize(tokenizer, doc)
        if ids.numel() <= seqlen:
            continue
        start = int(torch.randint(0, ids.numel() - seqlen + 1, (1,), generator=gen))
        windows.append(ids[start:start + seqlen])
    return torch.stack(windows)


def calibration_windows(source: str, tokenizer, nsamples: int = 128, seqlen: int = 2048, seed: int = 0) -> torch.Tensor:
    """LongTensor ``[nsamples, seqlen]`` of token windows from ``source`` (see the module docstring)."""
    _check_request(nsamples, seqlen)
    source = str(source)
    if source == "c4":
        return _c4_windows(tokenizer, nsamples, seqlen, seed)
    text = calibration_text(source)
    if not text:
        raise SparsekitError(f"calibration source {source} holds no text: pass a file with text in it")
    return sample_windows(tokenize(tokenizer, text), nsamples, seqlen, seed, source=source)
