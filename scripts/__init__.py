"""Scripts beside the library (not installed): ``bench/`` (speed), ``checks/`` (GPU correctness and install),
``demos/`` (the results of docs/results.md), and ``common.py``, what they share. Run one from the repository
root as a module, e.g. ``python -m scripts.bench.kernels --help``."""
