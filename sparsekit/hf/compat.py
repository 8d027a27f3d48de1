"""Every place sparsekit reaches past transformers' public API, in one module.

Checked against transformers 5.23.0 (the CPU test box) and 5.17 (the GPU image); the StaticCache
fallback keeps the 4.x constructor working. When a transformers upgrade breaks something, it
should break here:

* ``checkpoint_renamings``: the load-time key renamings (``transformers.conversion_mapping``,
  ``transformers.core_model_loading``; GPT-NeoX saves ``embed_out.weight`` for its ``lm_head``).
* ``make_static_cache``, ``LayerView``, ``cache_layers``, ``cache_layer``, ``layer_counters``: the per-layer
  objects of a ``StaticCache`` (``cache.layers[i]``, each with ``update(key, value, ...)``,
  ``keys``/``values`` tensors and a few counters).
* ``decode_forward_kwargs``: which optional arguments a model's ``forward`` takes.
* ``is_llama_rms_norm``: recognising the Llama-form RMSNorm by its source and ``variance_epsilon``.
* ``is_silu``: recognising SiLU among the activation classes of ``transformers.activations``.
* ``meta_skeleton``: a model with meta parameters and real buffers (no public ``init_empty_weights``
  in transformers 5), for streamed pruning.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn


# ----------------------------------------------------------------------------- checkpoint keys
def checkpoint_renamings(model: nn.Module, keys) -> dict[str, str]:
    """``{checkpoint key: model key}`` for the keys transformers renames on load (empty when this
    transformers has no conversion mappings: then checkpoints hold the model's own names)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        renamings = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]
        return {key: rename_source_key(key, renamings, [])[0] for key in keys}
    except Exception:  # a transformers without these conversion mappings saves the model's names
        return {}


# ----------------------------------------------------------------------------- the static KV cache
def make_static_cache(model: nn.Module, max_len: int):
    """A ``transformers.StaticCache`` for ``model`` holding ``max_len`` positions."""
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # older 4.x signature
        p = next(model.parameters())
        return StaticCache(config=model.config, max_batch_size=1, max_cache_len=max_len,
                           device=p.device, dtype=p.dtype)


def cache_layers(cache) -> list:
    """The per-layer objects of a cache (empty for a cache without them)."""
    return list(getattr(cache, "layers", []))


def cache_layer(cache, idx: int):
    """The object of layer ``idx`` of a cache."""
    return cache.layers[idx]


class LayerView:
    """One layer of a StaticCache, presented to that decoder layer as if it were the whole cache.

    The layer then never indexes the cache by its ``layer_idx``, so one compiled decoder layer
    serves every layer of the stack (no recompilation per layer index)."""

    is_compileable = True

    def __init__(self, layer):
        self.layer = layer

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.layer.update(key_states, value_states, *args, **kwargs)


def layer_counters(layer) -> list[tuple]:
    """The small mutable state of a cache layer, other than its key/value tensors:
    ``(tensor, None)`` for tensors, ``((layer, attribute), value)`` for integers."""
    out = []
    for key, val in vars(layer).items():
        if key in ("keys", "values"):
            continue
        if isinstance(val, torch.Tensor):
            out.append((val, None))
        elif isinstance(val, int) and not isinstance(val, bool):
            out.append(((layer, key), val))
    return out


# ----------------------------------------------------------------------------- forward signatures
def decode_forward_kwargs(model: nn.Module) -> tuple[dict, bool]:
    """``(extra kwargs, takes cache_position)`` for a one-token decode call of ``model.forward``:
    ``logits_to_keep=1`` where the model accepts it (only the last position's logits)."""
    params = inspect.signature(model.forward).parameters
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    return extra, "cache_position" in params


# ----------------------------------------------------------------------------- norms
def is_llama_rms_norm(module: nn.Module) -> bool:
    """An HF ``*RMSNorm`` of the Llama form (``weight * norm(x)``, eps in ``variance_epsilon``);
    Gemma-style norms (``1 + weight``) are not."""
    if not type(module).__name__.endswith("RMSNorm") or not hasattr(module, "variance_epsilon"):
        return False
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "self.weight * hidden_states.to(input_dtype)" in src


# ----------------------------------------------------------------------------- activations
def is_silu(module: nn.Module) -> bool:
    """SiLU as a module: torch's ``nn.SiLU`` or transformers' ``SiLUActivation`` (``ACT2FN["silu"]``,
    also registered as ``"swish"``), whose class is not part of its public API."""
    return isinstance(module, nn.SiLU) or type(module).__name__ in ("SiLUActivation", "SiLU")


# ----------------------------------------------------------------------------- skeletons
@contextlib.contextmanager
def parameters_on_meta():
    """Build modules with their parameters on the meta device and their buffers real (rotary tables,
    masks: computed in ``__init__``, not stored in checkpoints). transformers 5 has no public
    ``init_empty_weights``; this patches ``nn.Module.register_parameter`` for the duration."""
    original = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def meta_skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` with meta parameters (``dtype``) and real buffers, in eval mode:
    built as ``from_pretrained`` builds it, without allocating or initialising any weight."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


# ============================================================================= from_pretrained of a packed directory
# The two reaches of ``sparsekit.runtime.hf_quantizer`` (issue 24) past transformers' public API,
# checked against transformers 5.24.0: both names exist in transformers 5; in 4.x the quantizer is
# not reached at all (no ``register_quantizer`` there).
def point_weights_at(config, filename: str) -> None:
    """Make ``from_pretrained`` read its weights from ``filename`` inside the model directory instead of
    ``model.safetensors``: the load-time config attribute ``transformers_weights`` (transformers 5;
    ``save_pretrained`` drops it from the config it writes)."""
    config.transformers_weights = filename


def quiet_loading(model: nn.Module) -> dict:
    """Keep transformers' own loading step quiet about a model sparsekit fills itself afterwards:
    every tensor is "missing" from the stub file, and the tied embeddings "absent from the
    checkpoint". ``_keys_to_ignore_on_load_missing`` (the patterns the load report skips, a set per
    instance) ignores everything, and ``all_tied_weights_keys`` (the ``{target: source}`` pairs
    transformers ties after loading) is empty until :func:`restore_loading`; the loader ties the
    embeddings itself. Returns what :func:`restore_loading` puts back."""
    saved = {"_keys_to_ignore_on_load_missing": getattr(model, "_keys_to_ignore_on_load_missing", None),
             "all_tied_weights_keys": getattr(model, "all_tied_weights_keys", None)}
    model._keys_to_ignore_on_load_missing = set(saved["_keys_to_ignore_on_load_missing"] or ()) | {".*"}
    if saved["all_tied_weights_keys"] is not None:
        model.all_tied_weights_keys = {}
    return saved


def restore_loading(model: nn.Module, saved: dict) -> None:
    for name, value in saved.items():
        if value is not None or name == "_keys_to_ignore_on_load_missing":
            setattr(model, name, value)
