"""The host: output directories on its file system (claimed, locked, staged and renamed into place:
``atomic``, ``outlock``, ``leftovers``, ``manifest``, file modes: ``filemode``) and its memory (``memory``).
Nothing here knows about models. May import only ``sparsekit.errors`` (and itself).
"""
