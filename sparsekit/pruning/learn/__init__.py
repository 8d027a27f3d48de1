"""Learned sparsity masks (``sparsekit prune --learn-mask``): PATCH-style hybrid tiles and MaskLLM-style 2:4.

The weights stay frozen; what is learned are logits: one per 64x64 tile (dense or 2:4) and six per
group of 4 weights (which 2 to keep). They start from the one-shot choice of Wanda / SparseGPT /
magnitude scores and are trained on the calibration text with straight-through Gumbel sampling,
an annealed temperature and a sparsity regularizer. ``--allocation global`` ranks the tiles of the
whole model instead of each linear on its own (one-shot, or as the start of learning).

Modules: ``config`` (settings), ``choices`` (the parametrization), ``allocation`` (which tiles),
``scores`` (one-shot scores of the dense model), ``schedule`` (annealing and seeded draws),
``masking`` (masks on frozen linears), ``loop`` (the optimizer loop), ``checkpointing``,
``update`` (the SparseGPT update on a fixed mask), ``pipeline`` (``learn_prune``: all of it).
"""
from sparsekit.pruning.learn.config import LearnConfig

__all__ = ["LearnConfig"]
