"""The packed format: TCA-BME (``tcabme``), its safetensors shards, ``encode``, verify/inspect, and the
compressed-tensors interchange. May import ``sparsekit.hf``, ``errors`` and ``progress``; never pruning or the runtime.
"""
