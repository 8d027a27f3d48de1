"""The bundled pruning recipes: ``*.yaml`` files installed as the data package ``sparsekit.recipes``.

The source folder is the repository's top-level ``recipes/`` (pyproject maps it, as it maps ``cli``
and ``kernels``). This file only makes the folder a regular package, so that
``importlib.resources.files("sparsekit.recipes")`` finds it in an editable install too (setuptools'
editable finder does not resolve a namespace package nested in a regular one). Reading and resolving
recipes by name is ``sparsekit.pruning.recipes``' job.
"""
