"""scripts.demos: see scripts/__init__.py."""
