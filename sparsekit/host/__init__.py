"""The host, no models: output directories on its file system (claimed, locked, staged and renamed
into place: ``atomic``, ``outlock``, ``rename``; what is provably sparsekit's: ``manifest``; the sweep of
what killed runs left: ``leftovers``; file modes: ``filemode``), JSON files read with one-line errors
(``jsonfile``), and its memory (``memory``). May import only ``sparsekit.errors`` (and itself).
"""
