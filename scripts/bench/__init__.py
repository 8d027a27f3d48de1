"""scripts.bench: see scripts/__init__.py."""
