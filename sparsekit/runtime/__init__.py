"""The runtime: SparseLinear and its kernel glue, the one model loader, module swaps, decode fusions, the CATS module and the CUDA-graph greedy decoder.
May import ``sparsekit.hf``, ``pruning``, ``packed``, ``kernels``, ``errors`` and ``progress``; never evaluation or the CLI.
"""
