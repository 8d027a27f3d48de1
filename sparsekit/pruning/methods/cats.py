"""CATS (Lee et al. 2024): one activation threshold per gated MLP; the weights stay as they are.

A gated MLP (Llama, Mistral, Qwen2, SmolLM2: modules ``gate_proj``, ``up_proj``, ``down_proj`` and
``act_fn``) computes ``down(act(gate(x)) * up(x))``. CATS replaces ``a = act(gate(x))`` by
``a * (|a| >= t)``: gate activations smaller in magnitude than the MLP's threshold ``t`` are zeroed,
so the matching columns of ``down`` (and rows of ``up``) need not be read at all. ``t`` is the
k-quantile of ``|a|`` over calibration activations of that MLP, where ``k`` is the target
activation sparsity (0.5 zeroes half of the gate activations).

The quantile comes from a sample. Calibration produces far more values per MLP than
``torch.quantile`` accepts (128 x 2048 tokens x 11008 for a 7B model, against a limit of 2**24):
:class:`ActivationSample` keeps a seeded, uniform random sample of fixed size (``SAMPLE_SIZE``
values drawn with replacement, each mini-batch contributing in proportion to its share of the
values), or every value, and so the exact quantile, when there are no more than that. With 2**20
values the fraction of ``|a|`` below ``t`` is off by sqrt(k (1 - k) / 2**20) ~ 5e-4 (one standard
error) at most k.

Here are the math and the method: :class:`Cats` calibrates one decoder layer at a time on the
activations the engine (``sparsekit.pruning.engine``) hands over. While a layer is calibrated, forward
hooks on its MLPs' ``act_fn`` apply :func:`threshold_activation`, the function that the run-time module
(``sparsekit.runtime.cats.CatsActivation``, which installs the thresholds of ``sparsekit.json`` on a
loaded model) calls too; the hooks are removed once the layer is done, so the pruned model is left
as it was.
"""
from __future__ import annotations

import contextlib
import zlib

import torch
from torch import nn

from sparsekit.errors import SparsekitError
from sparsekit.hf.modules import find_gated_mlps, find_linears, is_gated_mlp, weight_out_in
from sparsekit.pruning.methods.base import Method, Observes

SAMPLE_SIZE = 2**20


def threshold_activation(a: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
    """CATS on gate activations ``a``: the values of magnitude below ``threshold`` set to zero."""
    t = threshold.to(a.dtype) if isinstance(threshold, torch.Tensor) else threshold
    return a.masked_fill(a.abs() < t, 0)


def threshold_for(values: torch.Tensor, sparsity: float) -> float:
    """The ``sparsity``-quantile of ``values`` (magnitudes; linear interpolation, as ``torch.quantile``)."""
    if not 0.0 <= float(sparsity) < 1.0:
        raise SparsekitError(f"activation sparsity {sparsity} is out of range: use a fraction in [0, 1), e.g. 0.5")
    if values.numel() == 0:
        raise SparsekitError("no activation values to take a threshold from: pass calibration data")
    return float(torch.quantile(values.reshape(-1).float(), float(sparsity)))


class ActivationSample:
    """A seeded uniform sample of ``size`` values out of ``total`` (all of them when ``total <= size``).

    Feed it with :meth:`add` in order; mini-batch ``i`` draws (with replacement, from its own
    values) the number of samples that brings the running count to ``size * seen / total``.
    """

    def __init__(self, total: int, size: int = SAMPLE_SIZE, seed: int = 0):
        if size < 1:
            raise SparsekitError(f"CATS sample size must be positive, got {size}")
        self.total, self.size = int(total), int(size)
        self.exact = self.total <= self.size
        self.seen = 0
        self.parts: list[torch.Tensor] = []
        self.gen = torch.Generator().manual_seed(int(seed))

    def add(self, values: torch.Tensor) -> None:
        flat = values.detach().reshape(-1)
        start, self.seen = self.seen, self.seen + flat.numel()
        if self.exact:
            self.parts.append(flat.float())
            return
        end = min(self.seen, self.total)
        n = round(self.size * end / self.total) - round(self.size * min(start, self.total) / self.total)
        if n > 0:
            idx = torch.randint(flat.numel(), (n,), generator=self.gen).to(flat.device)
            self.parts.append(flat[idx].float())

    def values(self) -> torch.Tensor:
        return torch.cat(self.parts) if self.parts else torch.empty(0)

    def threshold(self, sparsity: float) -> float:
        return threshold_for(self.values(), sparsity)


def require_gated_mlps(model: nn.Module, skip=(), fix: str = "use --method wanda or sparsegpt") -> dict[str, nn.Module]:
    """:func:`find_gated_mlps`, refusing a model without one (``fix``: what the one-line error advises)."""
    mlps = find_gated_mlps(model, skip=skip)
    if not mlps:
        what = "left after --skip" if find_gated_mlps(model) else "in this model"
        raise SparsekitError(
            f"CATS needs gated MLPs (gate_proj/up_proj/down_proj/act_fn, as in Llama, Mistral, Qwen2, SmolLM2), "
            f"and there is none {what} ({type(model).__name__}): {fix}"
        )
    return mlps


def cats_metadata(mlps: dict[str, dict], sparsity: float) -> dict:
    """The ``cats`` entry of ``sparsekit.json``: per-MLP thresholds and measured activation sparsity."""
    n = len(mlps)
    return {
        "target": float(sparsity),
        "quantile": f"torch.quantile of |act(gate(x))| over the calibration tokens: all of them, or a seeded "
                    f"uniform sample of {SAMPLE_SIZE} per MLP when there are more",
        "activation_sparsity": sum(r["activation_sparsity"] for r in mlps.values()) / n if n else 0.0,
        "mlps": {name: {"threshold": float(r["threshold"]), "activation_sparsity": float(r["activation_sparsity"]),
                        "samples": int(r["samples"]), "exact": bool(r["exact"])} for name, r in mlps.items()},
    }


def thresholds_from_metadata(meta: dict) -> dict[str, float]:
    """``{mlp name: threshold}`` from a ``sparsekit.json`` dict (empty when it is not a CATS run)."""
    cats = meta.get("cats") if isinstance(meta, dict) else None
    if not cats:
        return {}
    try:
        return {name: float(v["threshold"]) for name, v in cats["mlps"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise SparsekitError("sparsekit.json has a malformed \"cats\" entry (want mlps: {name: {threshold: t}}): "
                             "re-run `sparsekit prune --method cats`") from None


def read_thresholds(directory) -> dict[str, float]:
    """``{mlp name: threshold}`` from ``directory/sparsekit.json`` (empty when there is none or no CATS entry)."""
    from sparsekit.hf.metadata import PruneMetadata

    meta = PruneMetadata.read(directory)
    return thresholds_from_metadata({"cats": meta.cats}) if meta is not None else {}


def named_gated_mlps(model: nn.Module, names) -> dict[str, nn.Module]:
    """``{name: module}`` for these gated-MLP names of ``model``, refusing a name that is not one."""
    found = {}
    for name in names:
        try:
            mlp = model.get_submodule(name)
        except AttributeError:
            mlp = None
        if mlp is None or not is_gated_mlp(mlp):
            raise SparsekitError(f"CATS threshold for {name!r}, which is not a gated MLP of this "
                                 f"{type(model).__name__}: the checkpoint's sparsekit.json does not match its model")
        found[name] = mlp
    return found


@contextlib.contextmanager
def thresholds_in_force(model: nn.Module, thresholds: dict[str, float]):
    """Run ``model``'s named gated MLPs with these CATS thresholds for the duration of the block
    (forward hooks on ``act_fn``; the same function as the runtime's ``CatsActivation``)."""
    with act_hooks(named_gated_mlps(model, thresholds), lambda name: lambda module, inputs, output: threshold_activation(output, thresholds[name])):
        yield


def name_seed(name: str) -> int:
    """A stable small integer for a module name (Python's hash() changes between runs)."""
    return zlib.crc32(name.encode())


@contextlib.contextmanager
def act_hooks(mlps: dict[str, nn.Module], make_hook):
    """Forward hooks ``make_hook(name)`` on each gated MLP's ``act_fn`` for the duration of the block."""
    handles = [mlp.act_fn.register_forward_hook(make_hook(name)) for name, mlp in mlps.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class Cats(Method):
    """CATS as a method: no weight changes; a threshold per gated MLP, calibrated layer by layer.

    For each decoder layer: hooks on the gated MLPs' ``act_fn`` sample ``|act(gate(x))|``; each MLP
    gets its threshold (the target-sparsity quantile of the sample); a second pass through the
    thresholded layer counts the activation sparsity reached and (but for the last layer) writes
    the next layer's inputs. So the thresholds of layer i are measured with layers < i thresholded.
    """

    name = "cats"
    observes = Observes.GATED_MLP_ACTIVATIONS
    changes_weights = False
    report_key = "cats"
    progress_stage = "thresholds"

    def check_pattern(self, pattern) -> None:
        if not pattern.is_unstructured:
            raise SparsekitError(f"cats zeroes gate activations, not weights, so pattern {pattern} does not apply: "
                                 "use --pattern unstructured (the default) with --sparsity")

    def check_model(self, model: nn.Module, skip) -> None:
        require_gated_mlps(model, skip=skip)

    def skip_targets(self, model: nn.Module) -> list[str]:
        return list(find_linears(model)) + list(find_gated_mlps(model))

    def metadata(self, report: dict, sparsity: float) -> dict:
        return {"cats": cats_metadata(report[self.report_key], sparsity)}

    def calibrate_layer(self, layer, prefix, acts, *, sparsity, skip, seed, sample_size, write):
        mlps = find_gated_mlps(layer, prefix=prefix, skip=skip)
        tokens = acts.hidden.shape[0] * acts.hidden.shape[1]
        samples = {}
        for name, mlp in mlps.items():
            width = weight_out_in(mlp.gate_proj).shape[0]
            samples[name] = ActivationSample(tokens * width, sample_size or SAMPLE_SIZE,
                                             seed=seed * 1_000_003 + name_seed(name))
        with act_hooks(mlps, lambda name: lambda module, inputs, output: samples[name].add(output.abs())):
            acts.run(layer, write=False)  # no TF32 here: the thresholds must fit the model as it runs
        report, thresholds = {}, {}
        for name in mlps:
            t = samples[name].threshold(sparsity)
            # as CatsActivation's buffer: an fp32 scalar on the layer's device
            thresholds[name] = torch.as_tensor(t, dtype=torch.float32).to(acts.hidden.device)
            report[name] = {"threshold": t, "samples": len(samples[name].values()), "exact": samples[name].exact}
        del samples

        zeros = {name: [0, 0] for name in mlps}  # [zeros (a device tensor once counted), values]

        def thresholded(name):
            return lambda module, inputs, output: threshold_activation(output, thresholds[name])

        def counter(name):
            def hook(module, inputs, output):
                zeros[name][0] = zeros[name][0] + (output == 0).sum()
                zeros[name][1] += output.numel()
            return hook

        # the threshold hooks first: a forward hook's return value is what the hooks after it see
        with act_hooks(mlps, thresholded), act_hooks(mlps, counter):
            acts.run(layer, write=write)  # with write: the thresholded layer's outputs, next layer's inputs
        for name, (z, n) in zeros.items():
            report[name]["activation_sparsity"] = int(z) / n if n else 0.0
        return report
