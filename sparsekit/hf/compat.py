"""Every place sparsekit reaches past transformers' public API, in one module.

Checked against transformers 5.17.0 (the lowest that ``pyproject.toml`` admits; the GPU image) and
5.24.0 (the newest on 2026-11-25; CI runs the runtime tests on both). When a transformers upgrade
breaks something, it should break here, and loudly: nothing in this module swallows an error that
would turn a feature off.

* ``checkpoint_renamings``: the load-time key renamings (``transformers.conversion_mapping``,
  ``transformers.core_model_loading``; GPT-NeoX saves ``embed_out.weight`` for its ``lm_head``).
* ``make_static_cache``, ``LayerView``, ``cache_layers``, ``cache_layer``, ``layer_counters``: the per-layer
  objects of a ``StaticCache`` (``cache.layers[i]``, each with ``update(key, value, ...)``,
  ``keys``/``values`` tensors and a few counters).
* ``decode_forward_kwargs``: which optional arguments a model's ``forward`` takes.
* ``cache_kwarg``: the name a model's or decoder layer's ``forward`` takes the KV cache under
  (``past_key_values`` up to 5.2x, ``cache`` since; 5.24 still accepts the old name on the model's
  ``forward``, with a deprecation, until 5.40, but its decoder layers take only ``cache``).
* ``is_llama_rms_norm``: recognising the Llama-form RMSNorm by its source and ``variance_epsilon``.
* ``is_silu``: recognising SiLU among the activation classes of ``transformers.activations``.
* ``meta_skeleton``: a model with meta parameters and real buffers (accelerate's public
  ``init_empty_weights(include_buffers=False)``), for the packed loader and streamed pruning.
* ``no_weight_init``: building a model without running its weight initialisers
  (``transformers.initialization.no_init_weights``, what ``from_pretrained`` itself uses; in 5.17.0 and 5.24.0).

torch's own version-dependent names live in the twin module ``sparsekit.torch_compat``.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from sparsekit.errors import SparsekitError


# ----------------------------------------------------------------------------- checkpoint keys
def checkpoint_renamings(model: nn.Module, keys) -> dict[str, str]:
    """``{checkpoint key: model key}`` for the keys transformers renames on load (empty when this
    transformers has no conversion mappings: then checkpoints hold the model's own names)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversion mappings (4.x) saves the model's own names
        return {}
    renamings = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]
    return {key: rename_source_key(key, renamings, [])[0] for key in keys}


# ----------------------------------------------------------------------------- the static KV cache
def make_static_cache(model: nn.Module, max_len: int):
    """A ``transformers.StaticCache`` for ``model`` holding ``max_len`` positions."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


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


CACHE_KWARGS = ("cache", "past_key_values")  # newest first


def cache_kwarg(forward) -> str:
    """The keyword under which ``forward`` (a model's or a decoder layer's) takes the KV cache:
    ``"cache"`` (transformers 5.24) or ``"past_key_values"`` (5.17 and before). A ``SparsekitError``
    when it takes neither: the static decoder cannot hand that model its cache."""
    params = inspect.signature(forward).parameters
    for name in CACHE_KWARGS:
        if name in params:
            return name
    raise SparsekitError(f"{getattr(forward, '__qualname__', forward)} takes no KV cache argument "
                         f"({' or '.join(CACHE_KWARGS)}): the static decoder cannot run it")


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
def meta_skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` with meta parameters (``dtype``) and real buffers, in eval mode:
    built as ``from_pretrained`` builds it, without allocating or initialising any weight."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False), no_weight_init():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # under init_empty_weights transformers 5.24 leaves tied weights as two tensors
    return model.eval()


def no_weight_init():
    """A context in which building a transformers model runs none of its weight initialisers: for a skeleton whose
    every weight is loaded afterwards (on the meta device they still cost ~0.4 s for the 135M demo, 211 linears).
    Buffers computed in ``__init__`` (rotary frequencies) are untouched."""
    from transformers import initialization

    return initialization.no_init_weights()


# ============================================================================= from_pretrained of a packed directory
# The reaches of ``sparsekit.runtime.hf_quantizer`` (issue 24) past transformers' public API,
# checked against transformers 5.17.0 and 5.24.0; in 4.x the quantizer is not reached at all (no
# ``register_quantizer`` there).
def point_weights_at(config, filename: str) -> None:
    """Make ``from_pretrained`` read its weights from ``filename`` inside the model directory instead of
    ``model.safetensors``: the load-time config attribute ``transformers_weights`` (transformers 5;
    ``save_pretrained`` drops it from the config it writes). The quantizer sets it from the one hook
    that sees the model config before the weight files are looked for: ``update_attn_implementation``
    in 5.24, ``update_tp_plan`` / ``update_ep_plan`` in 5.17."""
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
