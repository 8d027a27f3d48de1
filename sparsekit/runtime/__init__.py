"""The runtime: SparseLinear and its kernel glue, the one model loader, module swaps, decode fusions, the CATS module, the dispatch plan (each layer in its fastest form), GPU timing and the CUDA-graph greedy decoder.
May import ``sparsekit.hf``, ``pruning``, ``packed``, ``kernels``, ``errors`` and ``progress``; never evaluation or the CLI.
"""
