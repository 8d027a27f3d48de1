"""``import sparsekit`` makes packed directories loadable by transformers' ``from_pretrained``.

Registering the ``"sparsekit"`` quantizer (``sparsekit.runtime.hf_quantizer.register``) needs
``transformers.quantizers``, which takes seconds to import, and ``import sparsekit`` stays cheap
(the CLI imports it on every run). So :func:`install` registers at once when that package is
already imported, and otherwise leaves a one-shot import hook that registers right after
``transformers.quantizers`` has finished importing (``from_pretrained`` imports it, and so do tools
that read a quantization_config first, such as lm-eval). The hook only waits for that package;
nothing of transformers is patched. The quantizer is named by string,
as the package's lazy exports are, so that importing this module imports nothing else.
"""
from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings

TRIGGER = "transformers.quantizers"
QUANTIZER = "sparsekit.runtime.hf_quantizer"


def register() -> None:
    """Register with transformers now; a transformers without the public registry gets a warning."""
    try:
        importlib.import_module(QUANTIZER).register()
    except Exception as e:  # never break the import of transformers itself
        warnings.warn(f"sparsekit cannot register with transformers ({type(e).__name__}: {e}): from_pretrained "
                      "will not load packed directories; load them with sparsekit.load", stacklevel=2)


class _ThenRegister(importlib.abc.Loader):
    """The trigger module's own loader, then :func:`register`."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = module.__loader__ = self.loader   # the module keeps its real loader
        self.loader.exec_module(module)
        register()


class _AfterTrigger(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when the trigger module is looked for, wraps the spec the other
    finders give so that :func:`register` runs once the module has executed, and steps aside."""

    def find_spec(self, name, path=None, target=None):
        if name != TRIGGER:
            return None
        uninstall()
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is not None and (spec := find(name, path, target)) is not None:
                break
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader)
        return spec


def installed() -> bool:
    return any(isinstance(f, _AfterTrigger) for f in sys.meta_path)


def install() -> None:
    """Register now if ``transformers.quantizers`` is imported, else when it is (once)."""
    if TRIGGER in sys.modules:
        register()
    elif not installed():
        sys.meta_path.insert(0, _AfterTrigger())


def uninstall() -> None:
    # a new list, not an edit of the one the import system may be iterating over right now
    sys.meta_path = [f for f in sys.meta_path if not isinstance(f, _AfterTrigger)]
