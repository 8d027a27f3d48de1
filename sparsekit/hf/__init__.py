"""Hugging Face plumbing: resolving and loading dense models and tokenizers, data sets, checkpoints, module finders, transformers compatibility.
May import only ``sparsekit.errors``, ``sparsekit.progress`` and ``sparsekit.host`` (and itself); never pruning, packed, kernels, the runtime or evaluation.
"""
