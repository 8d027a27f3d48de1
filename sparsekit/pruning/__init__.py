"""Pruning stage: the methods, sparsity patterns, recipes/settings and the layer-sequential engine behind ``sparsekit prune``.
May import only ``sparsekit.errors``, ``sparsekit.progress`` and ``sparsekit.hf`` (and itself), never packed, kernels, runtime or evaluation."""
