"""Reading and writing safetensors checkpoints one tensor at a time (streamed pruning).

- :class:`SafetensorsSource` memory-maps the shards of a local HF checkpoint (single file or
  ``model.safetensors.index.json``) and hands out single tensors. Each read copies the tensor out of
  the mapping (to the device, in the dtype asked for) and then drops the mapped pages from this
  process (``madvise(MADV_DONTNEED)``): they stay in the page cache but not in our resident memory.
- :class:`ShardedWriter` writes an HF sharded checkpoint whose layout is planned up front from the
  tensors' names, dtypes and shapes: each shard's header is written at once and every tensor's bytes
  land at their offset (``pwrite``) whenever the tensor is ready, in any order, so nothing waits in
  memory for its shard. ``close()`` checks that every tensor arrived and writes the index.
- :class:`ParamSlots` swaps a model's meta parameters for real tensors and back, keeping tied
  parameters tied (every slot holding the same parameter gets the same new one).
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
import warnings
from pathlib import Path

import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.host.filemode import public_file
from sparsekit.torch_compat import own_tensors, set_module_tensor

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
_PAGE = mmap.PAGESIZE


def nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise SparsekitError(f"cannot read the safetensors header of {path} ({e}): the checkpoint is damaged") from None
    return header, 8 + n


def safetensors_files(directory: str | os.PathLike) -> list[Path]:
    """The weight files of a local checkpoint directory (empty when it holds no safetensors)."""
    d = Path(directory)
    index = d / INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SparsekitError(f"{index} is damaged ({e}): re-download or re-save the checkpoint") from None
        return [d / n for n in names]
    return sorted(d.glob("*.safetensors")) if d.is_dir() else []


class SafetensorsSource:
    """Tensors of a local safetensors checkpoint, read one at a time (see the module doc)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        files = safetensors_files(directory)
        if not files:
            raise SparsekitError(f"{directory} holds no safetensors weights: streaming reads safetensors "
                                 "checkpoints only; use --offload memory")
        self.entries: dict[str, tuple[Path, torch.dtype, list[int], int, int]] = {}
        for file in files:
            if not file.is_file():
                raise SparsekitError(f"shard {file.name} is missing from {directory}: the checkpoint is incomplete")
            header, start = _header(file)
            for key, v in header.items():
                if key == "__metadata__":
                    continue
                if v.get("dtype") not in DTYPES:
                    raise SparsekitError(f"tensor {key} in {file.name} has dtype {v.get('dtype')}, which streaming "
                                         "does not read: use --offload memory")
                a, b = v["data_offsets"]
                self.entries[key] = (file, DTYPES[v["dtype"]], list(v["shape"]), start + a, start + b)
        self._maps: dict[Path, tuple[object, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key][1]

    def shape(self, key: str) -> list[int]:
        return self.entries[key][2]

    def total_bytes(self, dtype: torch.dtype | None = None) -> int:
        """The checkpoint's tensor bytes, or their size once cast to ``dtype`` (floating tensors)."""
        return sum(nbytes(dtype if dtype is not None and dt.is_floating_point else dt, shape)
                   for _, dt, shape, _, _ in self.entries.values())

    def _map(self, file: Path) -> mmap.mmap:
        with self._lock:
            if file not in self._maps:
                f = open(file, "rb")
                self._maps[file] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            return self._maps[file][1]

    def read(self, key: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``key`` as a new tensor on ``device`` (in ``dtype`` when given: floating tensors only)."""
        file, dt, shape, a, b = self.entries[key]
        want = dtype if dtype is not None and dt.is_floating_point else dt
        device = torch.device(device)
        if a == b:
            return torch.empty(shape, dtype=want, device=device)
        mm = self._map(file)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only mapping: torch warns that it is not writable
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=b - a, offset=a)
        try:
            if device.type == "cpu":
                out = torch.empty(shape, dtype=want)
                aligned = a % torch.empty((), dtype=dt).element_size() == 0  # view(dtype) needs an aligned offset
                out.view(-1).copy_((raw if aligned else raw.clone()).view(dt))
            else:
                out = raw.to(device).view(dt).reshape(shape).to(want)
        finally:
            del raw
            lo = a - a % _PAGE
            mm.madvise(mmap.MADV_DONTNEED, lo, b - lo)  # the pages stay cached, not resident here
        return out.reshape(shape)

    def close(self) -> None:
        for f, mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a tensor still views the mapping: the GC unmaps it later
                pass
            f.close()
        self._maps.clear()


class ShardedWriter:
    """An HF sharded safetensors checkpoint written tensor by tensor (see the module doc).

    ``plan``: ``[(key, dtype, shape)]`` in file order; shards hold at most ``max_bytes`` each (a
    tensor larger than that gets its own). One shard is named ``model.safetensors`` and needs no index.
    """

    def __init__(self, out_dir: str | os.PathLike, plan: list[tuple[str, torch.dtype, list[int]]], max_bytes: int):
        self.out_dir = Path(out_dir)
        groups: list[list[tuple[str, torch.dtype, list[int]]]] = [[]]
        size = 0
        for key, dtype, shape in plan:
            n = nbytes(dtype, shape)
            if groups[-1] and size + n > max_bytes:
                groups.append([])
                size = 0
            groups[-1].append((key, dtype, list(shape)))
            size += n
        count = len(groups)
        self.slots: dict[str, tuple[int, int, torch.dtype, list[int]]] = {}  # key -> (fd, offset, dtype, shape)
        self.weight_map: dict[str, str] = {}
        self.files: list[Path] = []
        self._fds: list[int] = []
        self.total_bytes = 0
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        for i, group in enumerate(groups, 1):
            name = SINGLE_NAME if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
            header: dict = {"__metadata__": {"format": "pt"}}
            offset = 0
            for key, dtype, shape in group:
                n = nbytes(dtype, shape)
                header[key] = {"dtype": NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + n]}
                offset += n
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            path = self.out_dir / name
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
            self._fds.append(fd)
            self.files.append(path)
            os.write(fd, struct.pack("<Q", len(text)) + text)
            os.ftruncate(fd, 8 + len(text) + offset)
            start = 8 + len(text)
            for key, dtype, shape in group:
                if key in self.slots:
                    raise SparsekitError(f"tensor {key} appears twice in the checkpoint: fix the source checkpoint")
                self.slots[key] = (fd, start + header[key]["data_offsets"][0], dtype, shape)
                self.weight_map[key] = name
                self._pending.add(key)
            self.total_bytes += offset

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` (on the CPU, of the planned dtype and shape) as ``key``."""
        fd, offset, dtype, shape = self.slots[key]
        if tensor.dtype != dtype or list(tensor.shape) != shape:
            raise SparsekitError(f"tensor {key} is {tensor.dtype} {list(tensor.shape)}, planned as {dtype} {shape}")
        data = memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
        with self._lock:
            self._pending.discard(key)

    def close(self) -> dict[str, str]:
        """Check that every tensor was written, close the files, write the index; the weight map."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._pending:
            raise SparsekitError(f"{len(self._pending)} tensors were never written (e.g. {sorted(self._pending)[0]})")
        for path in self.files:
            public_file(path)
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return self.weight_map

    def abort(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class ParamSlots:
    """The parameters and buffers of a model by name, to swap real tensors in and meta ones back."""

    def __init__(self, model: nn.Module):
        self.slots: dict[str, list[tuple[nn.Module, str, str]]] = {}
        self.canon: dict[str, str] = {}
        self.original: dict[str, torch.Tensor] = {}
        first: dict[int, str] = {}
        for mname, mod in model.named_modules(remove_duplicate=False):
            for _, kind, key, t in own_tensors(mod):
                name = f"{mname}.{key}" if mname else key
                canon = first.setdefault(id(t), name)
                self.canon[name] = canon
                self.slots.setdefault(canon, []).append((mod, kind, key))
                self.original.setdefault(canon, t)

    def names(self, prefix: str = "") -> list[str]:
        """Canonical names (one per distinct tensor) under ``prefix``."""
        return [n for n in self.slots if n.startswith(prefix)]

    def get(self, name: str) -> torch.Tensor:
        mod, _, key = self.slots[self.canon[name]][0]
        return getattr(mod, key)

    def set(self, name: str, tensor: torch.Tensor) -> None:
        """Put ``tensor`` into every slot of ``name`` (as one shared Parameter where it is a parameter)."""
        slots = self.slots[self.canon[name]]
        value = nn.Parameter(tensor, requires_grad=False) if slots[0][1] == "p" else tensor
        for mod, kind, key in slots:
            set_module_tensor(mod, kind, key, value)

    def reset(self, name: str) -> None:
        """Put the original (meta) tensor back."""
        canon = self.canon[name]
        for mod, kind, key in self.slots[canon]:
            set_module_tensor(mod, kind, key, self.original[canon])
