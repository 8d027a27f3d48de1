"""The one loader: any model directory (packed or dense), hub id or the demo alias, as a runnable HF model.

``load(id_or_path, device, dtype)`` resolves the name (``sparsekit.hf.models.resolve_model``), loads
the tokenizer, and opens the directory: a packed TCA-BME directory (holding
``tcabme.index.json``, written by ``sparsekit encode``) through the packed path below, anything else
as a plain HF checkpoint. Either way the CATS thresholds recorded in its ``sparsekit.json``
(``sparsekit prune --method cats``) are installed, here and nowhere else.

The packed path: build the model skeleton from the directory's ``config.json`` with parameters on the meta
device (no random weights are allocated or initialised; buffers such as rotary frequencies are
computed as usual), put a ``SparseLinear`` in place of every packed linear, assign the dense
tensors (embeddings, norms, ``lm_head``, layers left dense) straight onto ``device`` in ``dtype``,
tie the embeddings when the config says so, and return the model in eval mode. ``.generate()``
then runs on the sparse kernels (see ``sparsekit.runtime.sparse_linear`` for which path runs when).
"""
from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from sparsekit.errors import SparsekitError, SparsekitWarning
from sparsekit.hf import models
from sparsekit.hf.compat import checkpoint_renamings, meta_skeleton
from sparsekit.hf.modules import set_submodule
from sparsekit.packed.shards import INDEX_NAME, PackedCheckpoint, is_packed_dir, read_packed
from sparsekit.runtime.cats import install_from_checkpoint
from sparsekit.runtime.dispatch import check_prefer, plan_dispatch
from sparsekit.runtime.sparse_linear import SparseLinear, kernel, notice_once
from sparsekit.torch_compat import own_tensors, set_module_tensor

_REENCODE = "re-run `sparsekit encode` (or copy config.json of the source model into it)"


def check_packed_dir(path: Path) -> None:
    """A packed directory with its config.json, or one error line saying what it is instead."""
    if not path.exists():
        raise SparsekitError(f"no packed model at {path}: pass a directory written by `sparsekit encode`")
    if not path.is_dir():
        raise SparsekitError(f"{path} is a file: pass the packed model's directory")
    if not is_packed_dir(path):
        raise SparsekitError(
            f"{path} is not a packed TCA-BME directory (no {INDEX_NAME}): "
            "run `sparsekit encode PRUNED_DIR OUT_DIR` first"
        )
    if not (path / "config.json").exists():
        raise SparsekitError(f"{path} has no config.json: the packed directory is incomplete, {_REENCODE}")


def _tie_embeddings(model: nn.Module, config) -> None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or isinstance(out, SparseLinear):
        return
    if out.weight.device.type == "meta" or out.weight is not inp.weight:
        out.weight = inp.weight


def _rename_checkpoint_keys(model: nn.Module, state: dict) -> dict:
    """Map checkpoint names onto the model's where transformers renames them on load (e.g.
    GPT-NeoX saves ``embed_out.weight`` for its ``lm_head``): only keys the model lacks are touched."""
    expected = set(model.state_dict())
    unknown = [k for k in state if k not in expected]
    if not unknown:
        return state
    renamed = checkpoint_renamings(model, unknown)
    for key, new in renamed.items():
        if new != key and new in expected and new not in state:
            state[new] = state.pop(key)
    return state


def build_skeleton(path: Path, dtype: torch.dtype):
    """The HF model from ``path/config.json``: parameters on meta, buffers real (on the CPU)."""
    config = models.read_config(path, fix=_REENCODE)  # missing / not JSON / not a config: said as such
    try:
        model = meta_skeleton(config, dtype)
    except ValueError as e:
        raise SparsekitError(f"{path}: {config.model_type!r} is not a causal LM transformers can build ({e})")
    return model, config


def to_skeleton(model: nn.Module) -> None:
    """Every parameter and persistent buffer of ``model`` back on the meta device, as
    :func:`build_skeleton` leaves them (non-persistent buffers, e.g. rotary frequencies, stay)."""
    stored = set(model.state_dict(keep_vars=True))   # parameters and persistent buffers, by full name
    for prefix, module in model.named_modules():
        for owner, kind, name, t in own_tensors(module):
            if kind == "p" or (f"{prefix}.{name}" if prefix else name) in stored:
                meta = t.to("meta")
                set_module_tensor(owner, kind, name, nn.Parameter(meta, t.requires_grad) if kind == "p" else meta)


def load(id_or_path=None, device="cpu", dtype=None, *, prefer: str | None = None):
    """``(model, tokenizer)``: any model directory, packed or dense, a hub id or the demo alias, on
    ``device`` (``auto``/``cpu``/``cuda``) in ``dtype`` (default float16 on CUDA, float32 on CPU), in
    eval mode, with its CATS thresholds installed. Packed linears run as ``SparseLinear``.
    ``prefer`` (``"speed"`` or ``"memory"``, on a GPU): run each sparse layer in its fastest form,
    measured now (``runtime.dispatch.plan_dispatch``, which returns the report when called itself)."""
    dev = models.resolve_device(device)
    torch_dtype = models.resolve_dtype(dtype, dev)
    location = models.resolve_model(id_or_path)
    models.check_tokenizer_dir(location)  # a bad config.json or no tokenizer files: said first, as before
    with ThreadPoolExecutor(1, thread_name_prefix="sparsekit-tokenizer") as pool:
        tokenizer = pool.submit(models.build_tokenizer, location)   # read while the model loads
        model = open_model(location, dev, torch_dtype, prefer=prefer)
        return model, _tokenizer_result(tokenizer, location)


def _tokenizer_result(future, location):
    """The tokenizer built in the background; if that failed, built again here (an import that raced the
    model's in the other thread fails only there), so an error raised is the one a plain load raises."""
    try:
        return future.result()
    except Exception:  # noqa: BLE001 - retried in this thread: its error, if any, is the user's
        return models.build_tokenizer(location)


def open_model(location, device: torch.device, dtype: torch.dtype, *, prefer: str | None = None,
               check_kernels: bool = True) -> nn.Module:
    """The model of a resolved local directory, packed or dense, on ``device`` in eval mode, with
    the CATS thresholds of its ``sparsekit.json`` installed (the one place they are), and with
    ``prefer`` the dispatch plan applied (see :func:`load`); ``check_kernels`` as for :func:`make_ready`."""
    if prefer is not None:
        check_prefer(prefer)
    path = Path(location)
    model = _open_packed(path, device, dtype) if is_packed_dir(path) else models.open_dense(location, dtype)
    return make_ready(model, path, device, prefer=prefer, check_kernels=check_kernels)


def has_sparse_layers(model: nn.Module) -> bool:
    return any(isinstance(m, SparseLinear) for m in model.modules())


def make_ready(model: nn.Module, path: Path, device: torch.device, *, prefer: str | None = None,
               check_kernels: bool = True) -> nn.Module:
    """The last steps of every load (also of ``from_pretrained`` on a packed directory): the CATS
    thresholds of ``path/sparsekit.json``, the model on ``device`` in eval mode, and on a GPU
    ``prefer``'s dispatch plan and the kernels' load-time check. The check comes after the plan, and only
    when sparse layers are left: a plan that runs every layer dense (small weights are not even timed)
    compiles no kernel. ``check_kernels=False`` leaves the check to the caller (``eval --speed`` fuses
    the projections before it plans)."""
    install_from_checkpoint(model, path)
    model.to(device)  # the dense checkpoint; for a packed one the buffers built on the CPU (rotary frequencies, ...)
    model.eval()
    if device.type == "cuda" and has_sparse_layers(model):
        if prefer is not None:
            plan = plan_dispatch(model, prefer=prefer)   # runs the check itself before it times a group
            if plan.get("sp24_note"):
                notice_once(plan["sp24_note"])
        if check_kernels and has_sparse_layers(model):
            kernel()  # the kernels' load-time check: on failure one notice now, the reference path later
    return model


def load_packed(path, device="auto", dtype: torch.dtype | str | None = None, *, prefer: str | None = None,
                check_kernels: bool = True) -> nn.Module:
    """A HF causal LM whose packed linears are ``SparseLinear`` modules, on ``device`` (``auto``: the GPU
    when there is one, else the CPU, like ``load``), in eval mode.

    ``dtype`` applies to the dense tensors (embeddings, norms, biases; default float16 on CUDA, float32
    on the CPU); the packed values keep their stored dtype. The bundled kernels need fp16 activations,
    so keep the default on a GPU.
    ``prefer="speed"`` measures each group of sparse layers against cuBLAS now and runs each in its
    faster form (dense copies kept where dense wins; ``"memory"`` keeps the packed weights only).
    ``check_kernels=False``: the caller runs the kernels' load-time check (``sparse_linear.kernel``)
    before the first forward that may use them.
    """
    path = Path(path)
    check_packed_dir(path)
    dev = models.resolve_device(device)
    return open_model(path, dev, models.resolve_dtype(dtype, dev), prefer=prefer, check_kernels=check_kernels)


def _open_packed(path: Path, dev: torch.device, dtype: torch.dtype) -> nn.Module:
    ckpt = read_packed(path, device="cpu")  # raises SparsekitError on a corrupt/missing shard
    model, _ = build_skeleton(path, dtype)
    fill_skeleton(model, ckpt, path, dev, dtype)
    gen_cfg = path / "generation_config.json"
    if gen_cfg.exists():
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - not worth refusing the model for, but said
            warnings.warn(f"{gen_cfg} could not be read ({type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}): "
                          "generating with transformers' defaults", SparsekitWarning, stacklevel=2)
    return model


def fill_skeleton(model: nn.Module, ckpt: PackedCheckpoint, path: Path, dev: torch.device, dtype: torch.dtype) -> None:
    """Put the checkpoint into ``model``, whose parameters are on the meta device (its non-persistent
    buffers real): a ``SparseLinear`` on ``dev`` in place of every packed linear, every other tensor
    assigned on ``dev`` (floating ones in ``dtype``), the embeddings tied when the config says so.
    A tensor the model lacks, or one it has that the checkpoint does not fill, is one error line."""
    layers_info = getattr(ckpt, "layers", {}) or {}
    dense = dict(ckpt.dense)
    for name, packed in ckpt.packed.items():
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise SparsekitError(f"{path}: packed layer {name!r} does not exist in a {type(model).__name__}: "
                                 "the shards do not match config.json, re-run `sparsekit encode`")
        info = layers_info.get(name, {}) or {}
        transposed = bool(info.get("transposed", not isinstance(old, nn.Linear)))
        m, k = packed.shape
        if isinstance(old, nn.Linear):
            want = (old.out_features, old.in_features)
        else:  # GPT-2 Conv1D: weight [in, out], packed transposed as [out, in]
            want = (old.weight.shape[1], old.weight.shape[0])
        if (m, k) != tuple(want):
            raise SparsekitError(f"{path}: packed layer {name!r} is {m}x{k} but the model expects "
                                 f"{want[0]}x{want[1]}: the shards do not match config.json")
        bias = dense.pop(f"{name}.bias", None)
        if getattr(old, "bias", None) is not None and bias is None:
            raise SparsekitError(f"{path}: the bias of packed layer {name!r} is missing: re-run `sparsekit encode`")
        sl = SparseLinear.from_packed(packed, bias, device=dev, dtype=dtype, transposed=transposed)
        sl.tile_census = info.get("tiles")
        sl.pattern = info.get("pattern")
        set_submodule(model, name, sl)

    state = {k: (v.to(device=dev, dtype=dtype) if v.is_floating_point() else v.to(dev)) for k, v in dense.items()}
    state = _rename_checkpoint_keys(model, state)
    result = model.load_state_dict(state, strict=False, assign=True)
    del state, dense
    _tie_embeddings(model, model.config)
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.device.type == "meta"]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise SparsekitError(f"{path}: the checkpoint lacks {shown}: the packed directory is incomplete, re-run `sparsekit encode`")
    unexpected = [k for k in result.unexpected_keys if not k.endswith("inv_freq")]
    if unexpected:
        shown = ", ".join(unexpected[:4])
        raise SparsekitError(f"{path}: tensors {shown} do not belong to a {type(model).__name__}: "
                             "the shards do not match config.json, re-run `sparsekit encode`")
