"""Hugging Face plumbing: resolving and loading dense models and tokenizers, data sets, checkpoints, module finders, transformers compatibility.
May import only ``sparsekit.errors`` and ``sparsekit.progress`` (and itself); never pruning, packed, kernels, the runtime or evaluation.
"""
