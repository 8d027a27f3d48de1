"""Numba CUDA kernels for TCA-BME sparse x dense products (installed as ``sparsekit.kernels``)."""
