"""Moved to ``sparsekit.host.memory``; this alias stays for one release (the very same module object)."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("sparsekit.host.memory")
