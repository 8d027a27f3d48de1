"""Moving decoder layers to the device and back, one at a time (on CUDA, in the background):
``LayerMover`` for a model in host memory, ``DiskLayerMover`` for one streamed from disk, and
``ResidentLayers``, the device copies a read-only pass leaves for the next pass."""
from __future__ import annotations

import torch
from torch import nn

from sparsekit.torch_compat import module_tensors, set_module_tensor


def tensor_bytes(tensors) -> int:
    """Bytes the tensors hold."""
    return sum(t.numel() * t.element_size() for t in tensors)


class ResidentLayers:
    """Device copies of decoder layers that a read-only pass (OWL's outlier scan) leaves on the device
    for the pass after it, up to ``budget`` bytes: that pass then takes them instead of copying the
    same weights in again. The copies hold the layers' unchanged values (the read-only pass writes
    nothing). Layers are kept in order, so the next pass, which starts at layer 0, frees memory as
    it goes; a layer that does not fit is copied in as usual."""

    def __init__(self, budget: int):
        self.budget, self.used = max(0, int(budget)), 0
        self.kept: dict[int, list[torch.Tensor]] = {}
        self.refused = 0

    def keep(self, idx: int, tensors: list[torch.Tensor]) -> bool:
        size = tensor_bytes(tensors)
        if self.refused or self.used + size > self.budget:   # in order: once one is refused, keep no later one
            self.refused += 1
            return False
        self.kept[idx] = tensors
        self.used += size
        return True

    def take(self, idx: int, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Layer ``idx``'s copies if they match ``like`` (the layer's host tensors, in order), else None."""
        got = self.kept.pop(idx, None)
        if got is None:
            return None
        self.used -= tensor_bytes(got)
        if len(got) != len(like) or any(g.shape != t.shape or g.dtype != t.dtype for g, t in zip(got, like)):
            return None
        return got

    def report(self, layers: int) -> dict:
        return {"layers_kept": len(self.kept), "of": layers, "budget_bytes": self.budget, "kept_bytes": self.used}


class LayerMover:
    """Moves decoder layers to the device and back.

    On CUDA (``overlap``), a worker thread copies the next layer in on a side stream while the
    current one computes, and copies each pruned layer's tensors back into its original CPU
    tensors in the background; :meth:`finish` waits for those copies. Elsewhere it is a plain
    ``layer.to(device)`` / ``layer.to("cpu")``. As a context manager it finishes on exit.
    ``write=False`` (a pass that changes no weight, e.g. OWL's outlier scan) copies nothing back on CUDA;
    with ``resident`` it leaves each layer's device copies there (as the budget allows), and a mover
    given the same ``resident`` later takes them instead of copying the layer in.
    """

    def __init__(self, layers: nn.ModuleList, device: torch.device, overlap: bool, write: bool = True,
                 resident: ResidentLayers | None = None):
        self.layers, self.device, self.write = layers, device, write
        self.overlap = overlap and device.type == "cuda"
        self.resident = resident if self.overlap else None
        self.pending: dict[int, object] = {}
        self.offloads: list = []
        self.cpu: dict[int, list] = {}
        if self.overlap:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparsekit-mover")
            self.stream = torch.cuda.Stream(device)

    @staticmethod
    def _slots(layer: nn.Module):
        return module_tensors(layer)

    def _copy_in(self, idx: int):
        slots = list(self._slots(self.layers[idx]))
        host = [t.data if kind == "p" else t for _, kind, _, t in slots]
        kept = self.resident.take(idx, host) if self.resident is not None and self.write else None
        with torch.cuda.stream(self.stream):
            gpu = kept if kept is not None else [t.to(self.device, non_blocking=True) for t in host]
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return slots, gpu, ev

    def prefetch(self, idx: int) -> None:
        if self.overlap and 0 <= idx < len(self.layers) and idx not in self.pending:
            self.pending[idx] = self.pool.submit(self._copy_in, idx)

    def load(self, idx: int) -> nn.Module:
        layer = self.layers[idx]
        if not self.overlap:
            return layer.to(self.device)
        self.prefetch(idx)
        slots, gpu, ev = self.pending.pop(idx).result()
        main = torch.cuda.current_stream(self.device)
        main.wait_event(ev)
        originals = []
        for (mod, kind, key, t), g in zip(slots, gpu):
            g.record_stream(main)  # allocated on the side stream, used and freed on the main one
            if kind == "p":
                originals.append(t.data)
                t.data = g
            else:
                originals.append(t)
                set_module_tensor(mod, "b", key, g)
        self.cpu[idx] = (slots, originals)
        return layer

    def offload(self, idx: int) -> None:
        layer = self.layers[idx]
        if not self.overlap:
            layer.to("cpu")
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        gpu = []
        slots, originals = self.cpu.pop(idx)
        for (mod, kind, key, t), cpu in zip(slots, originals):  # the tensors that load() moved in
            gpu.append((t.data if kind == "p" else getattr(mod, key), cpu))
            if kind == "p":
                t.data = cpu  # the CPU tensor receives the device values below
            else:
                set_module_tensor(mod, "b", key, cpu)
        for mod, kind, key, t in list(self._slots(layer)):  # made on the device meanwhile (a cache the layer built)
            if t.device.type != "cpu":
                if kind == "p":
                    t.data = t.data.to("cpu")
                else:
                    set_module_tensor(mod, "b", key, t.to("cpu"))
        if not self.write:  # the CPU tensors still hold the same values
            if self.resident is not None:
                self.resident.keep(idx, [g for g, _ in gpu])
            return

        def copy_out():
            self.stream.wait_event(done)
            with torch.cuda.stream(self.stream):
                for g, cpu in gpu:
                    cpu.copy_(g)  # pageable destination: returns once the copy is complete
            self.stream.synchronize()

        self.offloads.append(self.pool.submit(copy_out))

    def __enter__(self) -> "LayerMover":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    def finish(self) -> None:
        if self.overlap:
            for f in self.offloads:
                f.result()
            self.offloads.clear()
            for f in self.pending.values():
                f.result()
            self.pending.clear()
            self.pool.shutdown()


class DiskLayerMover:
    """``LayerMover``'s interface over a checkpoint on disk (``sparsekit.pruning.streamed.StreamedModel``).

    ``load`` puts decoder layer ``idx``'s tensors, read from the memory-mapped shards in the compute
    dtype, into the meta skeleton; ``offload`` hands the pruned tensors to the output shards (cast
    to the save dtype) and puts the meta tensors back, so no layer stays in host memory. The layer's
    own buffers that the checkpoint does not hold (computed in ``__init__``) go to the device and back.
    On CUDA (``overlap``) one worker thread reads the next layer onto the device on a side stream
    while the current one computes, and another writes pruned layers out on a second side stream;
    :meth:`finish` waits for the writes. At most two layers wait to be written. ``write=False`` (a
    pass that changes no weight, e.g. OWL's outlier scan) only drops each layer after use.
    """

    def __init__(self, layers: nn.ModuleList, device: torch.device, overlap: bool, store, write: bool = True):
        self.layers, self.device, self.store, self.write = layers, device, store, write
        self.overlap = overlap and device.type == "cuda"
        self.pending: dict[int, object] = {}
        self.writes: list = []
        self.others: dict[int, list[str]] = {}
        if self.overlap:
            from concurrent.futures import ThreadPoolExecutor

            self.readers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparsekit-reader")
            self.writers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparsekit-writer")
            self.in_stream, self.out_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def _read(self, idx: int):
        names = [n for n in self.store.layer_names[idx] if n in self.store.keys]
        if not self.overlap:
            return {n: self.store.read(n, self.device) for n in names}, None
        with torch.cuda.stream(self.in_stream):
            tensors = {n: self.store.read(n, self.device) for n in names}
            ev = torch.cuda.Event()
            ev.record(self.in_stream)
        return tensors, ev

    def prefetch(self, idx: int) -> None:
        if self.overlap and 0 <= idx < len(self.layers) and idx not in self.pending:
            self.pending[idx] = self.readers.submit(self._read, idx)

    def load(self, idx: int) -> nn.Module:
        if self.overlap:
            self.prefetch(idx)
            tensors, ev = self.pending.pop(idx).result()
            main = torch.cuda.current_stream(self.device)
            main.wait_event(ev)
            for t in tensors.values():
                t.record_stream(main)  # made on the side stream, used and freed on the main one
        else:
            tensors, _ = self._read(idx)
        slots = self.store.slots
        for name, t in tensors.items():
            slots.set(name, t)
        self.others[idx] = [n for n in self.store.layer_names[idx] if n not in tensors]
        for name in self.others[idx]:
            slots.set(name, slots.original[name].to(self.device))
        return self.layers[idx]

    def offload(self, idx: int) -> None:
        slots = self.store.slots
        tensors = {n: slots.get(n).data for n in self.store.layer_names[idx] if n in self.store.keys}
        for name in list(tensors) + self.others.pop(idx, []):
            slots.reset(name)
        if not self.write:
            return
        if not self.overlap:
            for name, t in tensors.items():
                self.store.write(name, t)
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        for t in tensors.values():
            t.record_stream(self.out_stream)

        def write_out():
            self.out_stream.wait_event(done)
            with torch.cuda.stream(self.out_stream):
                for name, t in tensors.items():
                    self.store.write(name, t)
            self.out_stream.synchronize()

        if len(self.writes) >= 2:  # a disk slower than the compute: wait rather than pile layers up on the device
            self.writes.pop(0).result()
        self.writes.append(self.writers.submit(write_out))

    def __enter__(self) -> "DiskLayerMover":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    def finish(self) -> None:
        if self.overlap:
            try:
                for f in self.writes:
                    f.result()
                for f in self.pending.values():
                    f.result()
            finally:
                self.writes.clear()
                self.pending.clear()
                self.readers.shutdown()
                self.writers.shutdown()
