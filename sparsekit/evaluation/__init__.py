"""Evaluation: perplexity (WikiText-2 protocol), prefill/decode speed against the dense twin, the environment report.
May import every earlier stage (``hf``, ``pruning``, ``packed``, ``kernels``, ``runtime``, ``errors``, ``progress``); never the CLI.
"""
