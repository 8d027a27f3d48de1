"""``from_pretrained`` on a packed directory: sparsekit's quantizer in transformers' public registry.

transformers hands a checkpoint whose ``config.json`` names ``quantization_config.quant_method`` to
the quantizer registered under that name (``transformers.quantizers.register_quantizer`` and
``register_quantization_config``). ``import sparsekit`` registers ``"sparsekit"`` (see
``sparsekit.autoregister``); ``sparsekit encode`` writes the config (``sparsekit.packed.quantconfig``).
Then ``AutoModelForCausalLM.from_pretrained(packed_dir, dtype=..., device_map=...)`` runs:

1. :class:`SparsekitConfig` takes the fields encode writes and nothing else (``quantconfig.check``):
   a tampered config is one error line before anything is built or read;
2. ``validate_environment``: the whole model goes on one device (``device_map`` None or "cpu", "cuda",
   "cuda:N", {"": device}; "auto" is cuda when there is a GPU, as in ``sparsekit.load``); offloading
   to disk or spreading over devices is one error line;
3. the hook that sees the model config before transformers looks for weight files
   (``update_attn_implementation``; ``update_tp_plan`` in transformers 5.17) points it at
   ``tcabme.stub.safetensors``: nothing for transformers to read;
4. before loading (the skeleton is on meta): the directory is checked against the config, every
   shard is read and its sha256 checked, and the packed linears are taken out so that transformers
   allocates nothing for them;
5. transformers allocates what is left (embeddings, norms, ...) and reads nothing;
6. after loading: the loader's ``fill_skeleton`` puts the checkpoint in, exactly as ``load_packed``
   does, and ``make_ready`` installs the CATS thresholds and moves the model to its device
   (on a GPU, the kernels' load-time check; on the CPU, the reference path and its one notice).

``save_pretrained`` refuses with one line: the packed form is written by ``sparsekit encode``.
``model.dequantize()`` turns the model dense (``nn.Linear`` / ``Conv1D`` again), which then saves,
trains and takes adapters as any dense model does.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from sparsekit.errors import SparsekitError
from sparsekit.hf import compat, models
from sparsekit.hf.modules import Conv1D, set_submodule
from sparsekit.packed import quantconfig
from sparsekit.packed.shards import INDEX_NAME, read_packed
from sparsekit.runtime.loader import check_packed_dir, fill_skeleton, make_ready, to_skeleton
from sparsekit.runtime.sparse_linear import SparseLinear, release_kernel_caches

SAVE_REFUSAL = ("save_pretrained cannot write a packed sparsekit model: run `sparsekit encode` on the pruned "
                "checkpoint to pack it, or call model.dequantize() first to save it dense")
_SPREADING = ("balanced", "balanced_low_0", "sequential")


class SparsekitConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a packed directory, as data (``sparsekit.packed.quantconfig``)."""

    def __init__(self, **fields):
        quantconfig.check(fields)
        self.__dict__.update(fields)


def target_device(device_map) -> torch.device:
    """The one device ``from_pretrained``'s ``device_map`` (as transformers normalised it) puts the
    model on, or one error line saying what to pass."""
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, str):
        if device_map in _SPREADING:
            raise SparsekitError(f"device_map={device_map!r} spreads a model over several devices; a packed sparsekit "
                                 "model runs on one: pass device_map='cuda', 'cpu' or 'auto'")
        return models.resolve_device(device_map)
    values = {str(v) if not isinstance(v, int) else f"cuda:{v}" for v in dict(device_map).values()}
    if "disk" in values:
        raise SparsekitError("device_map offloads to disk: packed sparsekit layers cannot be offloaded; pass "
                             "device_map='cuda' or 'cpu'")
    if len(values) != 1:
        raise SparsekitError(f"device_map puts the model on {', '.join(sorted(values))}; a packed sparsekit model runs "
                             "on one device: pass device_map='cuda', 'cpu' or 'auto'")
    return models.resolve_device(values.pop())


class SparsekitHfQuantizer(HfQuantizer):
    """Loads a packed TCA-BME directory through ``from_pretrained`` (see the module doc)."""

    requires_calibration = True   # only pre-packed checkpoints: nothing is packed on the fly

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self._path: Path | None = None
        self._ckpt = None
        self._linears: dict[str, nn.Module] = {}
        self._quieted: dict = {}

    def validate_environment(self, device_map=None, **kwargs):
        self.device = target_device(device_map)

    def update_device_map(self, device_map):
        return {"": str(self.device)}

    def update_dtype(self, dtype):
        self.dtype = models.resolve_dtype(dtype, self.device)
        return self.dtype

    def point_at_stub(self, config):
        """Send transformers to the stub for its weights (the quantizer fills the model itself)."""
        compat.point_weights_at(config, quantconfig.STUB_NAME)
        return config

    # the hooks that see the model config before transformers looks for weight files: 5.24 calls
    # update_attn_implementation, 5.17 update_tp_plan and update_ep_plan (see hf.compat.point_weights_at)
    update_attn_implementation = update_tp_plan = update_ep_plan = point_at_stub

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        path = local_directory(model, checkpoint_files)
        check_packed_dir(path)
        quantconfig.check_directory(quantconfig.check(self.quantization_config.to_dict()), path)
        self._path, self._ckpt = path, read_packed(path, device="cpu")   # every shard read, sha256 checked
        for name in self._ckpt.packed:   # out of transformers' way: it would allocate their dense weights
            try:
                self._linears[name] = model.get_submodule(name)
            except AttributeError:
                continue   # fill_skeleton names it
            set_submodule(model, name, vacant(self._linears[name]))
        self._quieted = compat.quiet_loading(model)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        compat.restore_loading(model, self._quieted)
        for name, linear in self._linears.items():
            set_submodule(model, name, linear)
        to_skeleton(model)   # what transformers allocated goes; the checkpoint comes in, as in load_packed
        ckpt, self._ckpt, self._linears = self._ckpt, None, {}
        fill_skeleton(model, ckpt, self._path, self.device, self.dtype)
        return make_ready(model, self._path, self.device)

    def is_serializable(self, *args, **kwargs):
        raise SparsekitError(SAVE_REFUSAL)

    @property
    def is_trainable(self) -> bool:
        return False

    def _dequantize(self, model, dtype=None):
        for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, SparseLinear)]:
            set_submodule(model, name, dense_module(layer, dtype))
        release_kernel_caches()
        return model


def vacant(linear: nn.Module) -> nn.Module:
    """A stand-in for a packed linear while transformers loads: the same class with no output
    features, so that its weight initialisation (model code touches e.g. ``c_proj.weight``) finds a
    weight, and it allocates nothing. Another class stays as it is."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # "Initializing zero-element tensors is a no-op"
        if isinstance(linear, nn.Linear):
            return nn.Linear(linear.in_features, 0, bias=linear.bias is not None, dtype=linear.weight.dtype)
        if Conv1D and isinstance(linear, Conv1D):
            return Conv1D(0, linear.weight.shape[0])
    return linear


def dense_module(layer, dtype: torch.dtype | None = None) -> nn.Module:
    """The dense layer a ``SparseLinear`` was packed from: ``nn.Linear``, or GPT-2's ``Conv1D``."""
    linear = layer.to_linear(dtype)
    if not layer.transposed or not Conv1D:
        return linear
    with torch.device("meta"):
        conv = Conv1D(layer.out_features, layer.in_features)
    conv.weight = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
    bias = linear.bias if linear.bias is not None else torch.zeros(layer.out_features, dtype=linear.weight.dtype)
    conv.bias = nn.Parameter(bias.detach().to(linear.weight.device), requires_grad=False)
    return conv


def local_directory(model, checkpoint_files) -> Path:
    """The packed directory: the one holding the stub transformers resolved. For a hub id, that is a
    snapshot in the hub cache (``CACHE/models--ORG--NAME/snapshots/COMMIT``) where transformers
    fetched only the config and the stub: the rest of that same commit is fetched into that cache."""
    if not checkpoint_files:
        raise SparsekitError("from_pretrained found no packed directory: pass the directory `sparsekit encode` wrote")
    path = Path(checkpoint_files[0]).parent
    name = str(getattr(model.config, "name_or_path", "") or "")
    if not (path / INDEX_NAME).is_file() and name and not Path(name).is_dir() and path.parent.name == "snapshots":
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(name, revision=path.name, cache_dir=path.parents[2]))
    return path


def register() -> None:
    """Register ``"sparsekit"`` with transformers' quantizer registry (a second call does nothing)."""
    for add, cls in ((register_quantization_config, SparsekitConfig), (register_quantizer, SparsekitHfQuantizer)):
        try:
            add(quantconfig.QUANT_METHOD)(cls)
        except ValueError:   # already registered: a second import, or a reloaded module
            pass
