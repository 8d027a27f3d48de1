"""Streamed pruning: a checkpoint on disk is pruned without ever being whole in host memory.

``--offload disk`` (or ``auto`` when the model would not fit comfortably in free host memory, see
:func:`choose_offload`) replaces ``load_model`` with a :class:`StreamedModel`:

- the model is a skeleton on the meta device (``hf.compat.meta_skeleton``: buffers such as rotary
  tables are real, no parameter is allocated);
- the tensors outside the decoder stack that the run needs (embeddings, final norm; the output head
  only when it is pruned or tied to the embeddings) are read before the layer loop; the capture of
  layer 0's inputs needs nothing else;
- ``mover`` gives the engine an ``offload.DiskLayerMover``: each decoder layer is read from the
  memory-mapped shards just before it is needed (in the background on CUDA) and written into the
  output shards as soon as it is pruned, then dropped;
- :meth:`finish` writes the tensors outside the stack (an untied head is read and copied only now),
  the config, tokenizer and ``sparsekit.json``; the output directory is the claim's staging folder
  (``host.atomic``), renamed into place only when everything is written.

The output keeps the source checkpoint's tensor names; floating tensors are stored in the save dtype
exactly as the in-memory path stores them, so both paths write the same tensors, bit for bit.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from sparsekit.errors import SparsekitError
from sparsekit.hf import modules as L
from sparsekit.hf.compat import checkpoint_renamings, meta_skeleton
from sparsekit.host.memory import available_memory
from sparsekit.hf.streaming import SafetensorsSource, ShardedWriter, safetensors_files

OFFLOAD_MODES = ("auto", "memory", "disk")
COMFORT = 0.5  # auto streams when the model takes more than this fraction of the available memory


def choose_offload(offload: str | None, location: str, dtype: torch.dtype) -> tuple[str, str | None, str]:
    """``(mode, local checkpoint directory or None, why)`` for ``--offload`` (see the module doc)."""
    offload = (offload or "auto").lower()
    if offload not in OFFLOAD_MODES:
        raise SparsekitError(f"unknown --offload {offload!r}: choose one of {', '.join(OFFLOAD_MODES)}")
    if offload == "memory":
        return "memory", None, "asked for"
    directory = location if Path(location).is_dir() else _snapshot(location, required=offload == "disk")
    if directory is None:
        return "memory", None, "the hub snapshot could not be fetched to stream it"
    if not safetensors_files(directory):
        if offload == "disk":
            raise SparsekitError(f"{location} holds no safetensors weights: --offload disk streams safetensors "
                                 "checkpoints only; use --offload memory")
        return "memory", None, "no safetensors weights to stream"
    if offload == "disk":
        return "disk", directory, "asked for"
    need = SafetensorsSource(directory).total_bytes(dtype)
    free = available_memory()
    if free is not None and need > COMFORT * free:
        return "disk", directory, f"the model needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB of host memory is free"
    return "memory", None, "the model fits in host memory"


SNAPSHOT_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def _snapshot(repo_id: str, required: bool) -> str | None:
    """The local snapshot of hub model ``repo_id`` with its safetensors, config and tokenizer files
    (what ``from_pretrained`` downloads too, into the same cache); None when ``auto`` cannot get it
    (``from_pretrained`` then reports the problem itself)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=SNAPSHOT_FILES)
    except Exception as e:
        if required:
            raise SparsekitError(f"cannot fetch the snapshot of {repo_id} to stream it ({type(e).__name__}): "
                                 "download it first or use --offload memory") from None
        return None


class StreamedModel:
    """A meta skeleton of the checkpoint in ``directory`` plus what streams its tensors (module doc)."""

    def __init__(self, directory: str, dtype: torch.dtype, save_dtype: torch.dtype, max_shard_bytes: int = 5 * 10**9):
        from sparsekit.hf.models import read_config
        from sparsekit.hf.streaming import ParamSlots

        self.directory, self.dtype, self.save_dtype, self.max_shard_bytes = directory, dtype, save_dtype, max_shard_bytes
        self.model = meta_skeleton(read_config(directory), dtype)
        self.source = SafetensorsSource(directory)
        self.slots = ParamSlots(self.model)
        self.stack_name, layers = L.find_decoder_layers(self.model)
        renames = checkpoint_renamings(self.model, self.source.keys())
        self.keys: dict[str, list[str]] = {}  # canonical tensor name -> the source keys holding it
        for key in self.source.keys():
            name = renames.get(key, key)
            if name in self.slots.canon:
                canon = self.slots.canon[name]
                want = list(self.slots.original[canon].shape)
                if self.source.shape(key) != want:
                    raise SparsekitError(f"tensor {key} of {directory} has shape {self.source.shape(key)}, the model "
                                         f"expects {want}: streaming cannot convert it; use --offload memory")
                self.keys.setdefault(canon, []).append(key)
        missing = [n for n in self.slots.names() if n not in self.keys and self.slots.original[n].device.type == "meta"]
        if missing:
            raise SparsekitError(f"{directory} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
                                 "streaming copies the checkpoint's tensors and cannot make up missing ones; "
                                 "use --offload memory")
        self.layer_names = [self.slots.names(f"{self.stack_name}.{i}.") for i in range(len(layers))]
        self.zeros: dict[str, int] = {}
        self.writer: ShardedWriter | None = None

    # ------------------------------------------------------------------ reading
    def _outside(self) -> list[str]:
        prefix = self.stack_name + "."
        return [n for n in self.keys if not n.startswith(prefix)]

    def load_outside(self, skip) -> None:
        """Read the tensors outside the stack that the run needs (module doc) into the skeleton."""
        from sparsekit.pruning.outside import outside_linears

        model = self.model
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        emb_ids = {id(p) for p in emb.parameters()} if emb is not None else set()
        pruned = set(outside_linears(model, self.stack_name, skip).values())
        later = {id(p) for p in head.parameters()} - emb_ids if head is not None and head not in pruned else set()
        for name in self._outside():
            if id(self.slots.original[name]) not in later:
                self.slots.set(name, self.read(name, "cpu"))

    def read(self, name: str, device) -> torch.Tensor:
        """Tensor ``name`` (canonical) from the checkpoint, on ``device`` in the compute dtype."""
        return self.source.read(self.keys[name][0], device, self.dtype)

    def mover(self, layers, device, overlap, write: bool = True):
        """The engine's ``layer_mover``: a ``DiskLayerMover`` over this checkpoint (``write=False``:
        a read-only pass, e.g. OWL's outlier scan)."""
        from sparsekit.pruning.offload import DiskLayerMover

        return DiskLayerMover(layers, device, overlap, self, write=write)

    # ------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def writing(self, claim) -> Iterator[Path]:
        """The claim's staging folder with the output shards planned in it; renamed into place on success."""
        prefix = self.stack_name + "."
        order = {n: i for i, n in enumerate(self.slots.names())}

        first = order[self.layer_names[0][0]] if self.layer_names and self.layer_names[0] else 0

        def rank(name: str):  # what comes before the stack (embeddings), the layers in order, the rest
            if name.startswith(prefix):
                return (1, int(name[len(prefix):].split(".")[0]), order[name])
            return (0 if order[name] < first else 2, 0, order[name])

        plan = []
        for name in sorted(self.keys, key=rank):
            for key in self.keys[name]:
                dt = self.source.dtype(key)
                plan.append((key, self.save_dtype if dt.is_floating_point else dt, self.source.shape(key)))
        with claim.staging() as tmp:
            self.writer = ShardedWriter(tmp, plan, self.max_shard_bytes)
            try:
                yield tmp
            finally:
                self.writer.abort()
                self.source.close()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Store tensor ``name`` (any device; floating tensors are cast to the save dtype)."""
        if tensor.is_floating_point():
            tensor = tensor.to(self.save_dtype)
            if tensor.dim() == 2:
                self.zeros[name] = int((tensor == 0).sum())
        cpu = tensor.cpu()
        for key in self.keys[name]:
            self.writer.write(key, cpu)

    def write_outside(self) -> None:
        """Write the tensors outside the stack (an untied head not read so far is read now)."""
        for name in self._outside():
            t = self.slots.get(name)
            if t.device.type == "meta":
                t = self.read(name, "cpu")  # in the compute dtype first, as the in-memory path has it
            self.write(name, t.data)
            self.slots.reset(name)

    def finish(self, tmp: Path, tokenizer, metadata, output: Path | None = None) -> None:
        """Close the shards and write the config, tokenizer, ``metadata`` (a ``PruneMetadata``) and the model
        card beside them."""
        from sparsekit.hf.checkpoint import write_metadata
        from sparsekit.host.filemode import public_tree

        self.writer.close()
        config = self.model.config
        config.architectures = [type(self.model).__name__]
        config.dtype = self.save_dtype
        config.save_pretrained(tmp)
        if getattr(self.model, "generation_config", None) is not None and self.model.can_generate():
            self.model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_metadata(tmp, metadata, replacing=output)
        public_tree(tmp)

    def recount(self, layers: dict[str, dict]) -> None:
        """The pruned linears' sparsity as written (in the save dtype, like the in-memory path's recount)."""
        for module, r in layers.items():
            name = self.slots.canon.get(f"{module}.weight")
            if name in self.zeros:
                r["sparsity"] = self.zeros[name] / (r["shape"][0] * r["shape"][1])
