"""scripts.checks: see scripts/__init__.py."""
