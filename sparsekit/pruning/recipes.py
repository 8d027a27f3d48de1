"""Pruning settings: defaults < recipe file < explicit arguments (CLI flags).

A recipe is a small YAML file::

    method: wanda
    pattern: "2:4"          # quote N:M: bare 2:4 is a base-60 integer in YAML 1.1
    sparsity: null          # null: the pattern's own ratio (2:4 -> 0.5)
    calibration: {dataset: wikitext2, nsamples: 128, seqlen: 2048, seed: 0}
    skip: [lm_head]
    sparsegpt: {blocksize: 128, damp: 0.01}   # optional
    cats: 0.5               # optional: CATS thresholds (this activation sparsity) on top of a weight method
    allocation: owl         # optional: layer (default) | global (hybrid tiles) | owl (per-layer sparsity)
    owl: {lambda: 0.08, m: 5, windows: 16}    # optional, with allocation: owl
    refine: dsnot           # optional: DSnoT mask refinement after the method
    dsnot: {cycles: 50}     # optional
    update: admm            # optional: ADMM weight update on the final mask
    admm: {iters: 20}       # optional (also for method: admm)

``description`` is free text (the line ``sparsekit recipes`` shows). Any other key is an error.
:func:`resolve_settings` returns a validated ``PruneSettings``.

A recipe is named by a path or by the name of a bundled one (``wanda-2of4``: the repository's
``recipes/`` folder, installed as the data package ``sparsekit.recipes``): an existing file wins, else
the bundled recipe of that name (``.yaml`` optional), else an error that lists the bundled names.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from sparsekit.errors import SparsekitError
from sparsekit.pruning.settings import PruneSettings

DEFAULTS: dict[str, Any] = {
    "method": "wanda",
    "pattern": "unstructured",
    "sparsity": None,  # None: the pattern's default (unstructured 0.5, N:M 1 - N/M, hybrid 0.25)
    "dataset": "wikitext2",
    "nsamples": 128,
    "seqlen": 2048,
    "seed": 0,
    "skip": ["lm_head"],
    "prune_lm_head": False,  # lm_head stays dense whatever --skip says, unless this is set
    "blocksize": 128,
    "damp": 0.01,
    "cats": None,  # stacked CATS: target activation sparsity calibrated after a weight method, or None
    "allocation": "layer",  # every linear at the target; "global" (hybrid tiles, one ranking); "owl" (per layer)
    "owl_lambda": 0.08,  # OWL's paper defaults (lambda, M); the scan reads 16 calibration windows
    "owl_m": 5.0,
    "owl_windows": 16,
    "update": None,  # None: the method's own weights; "admm": ADMM's update on the final mask
    "admm_iters": 20,
    "refine": None,  # None, or "dsnot"
    "dsnot_cycles": 50,
}

_TOP_KEYS = {"description", "method", "pattern", "sparsity", "calibration", "skip", "sparsegpt", "cats", "allocation",
             "owl", "update", "admm", "refine", "dsnot"}
_CALIB_KEYS = {"dataset", "nsamples", "seqlen", "seed"}
_SPARSEGPT_KEYS = {"blocksize", "damp"}
# recipe sub-sections whose keys are the settings prefix_key: owl: {lambda: 0.1} -> owl_lambda
_PREFIXED = {"owl": {"lambda", "m", "windows"}, "admm": {"iters"}, "dsnot": {"cycles"}}
UPDATES = ("admm",)
REFINES = ("dsnot",)


def _check_keys(where: str, got: dict, allowed: set[str], path) -> None:
    bad = sorted(set(got) - allowed)
    if bad:
        raise SparsekitError(
            f"recipe {path}: unknown key{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))} in {where}: "
            f"allowed keys are {', '.join(sorted(allowed))}"
        )


BUNDLED_PACKAGE = "sparsekit.recipes"
_SUFFIXES = (".yaml", ".yml")


class BundledRecipe(NamedTuple):
    name: str          # the file name without .yaml: what --recipe accepts
    description: str   # the recipe's description field ("" when it has none)
    path: str          # where the installed file is


def _bundled_files() -> dict[str, Any]:
    """``{name: Traversable}`` of the bundled recipes (empty if the data package is missing)."""
    from importlib import resources

    try:
        root = resources.files(BUNDLED_PACKAGE)
    except ModuleNotFoundError:
        return {}
    return {f.name.rsplit(".", 1)[0]: f for f in sorted(root.iterdir(), key=lambda f: f.name.rsplit(".", 1)[0])
            if f.is_file() and f.name.endswith(_SUFFIXES)}


def bundled_recipes() -> list[BundledRecipe]:
    """The recipes shipped with sparsekit, sorted by name."""
    import yaml

    out = []
    for name, f in _bundled_files().items():
        try:
            data = yaml.safe_load(f.read_text())
        except yaml.YAMLError:
            data = None
        desc = data.get("description") if isinstance(data, dict) else None
        out.append(BundledRecipe(name, "" if desc is None else str(desc), str(f)))
    return out


def find_recipe(recipe: str | Path):
    """The file a ``--recipe`` value names: an existing file path wins, else the bundled recipe of
    that name (``wanda-2of4`` or ``wanda-2of4.yaml``); anything else is a one-line error listing the
    bundled names. Returns a ``Path`` or an ``importlib.resources`` Traversable (both ``read_text()``)."""
    path = Path(recipe).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise SparsekitError(f"recipe {recipe} is a directory: pass a YAML file or the name of a bundled recipe")
    bundled = _bundled_files()
    text = str(recipe)
    name = next((text[: -len(x)] for x in _SUFFIXES if text.endswith(x)), text)
    if "/" not in text and "\\" not in text and name in bundled:
        return bundled[name]
    names = ", ".join(bundled) or "(none installed)"
    if path.stem in bundled and path.suffix in _SUFFIXES:  # e.g. recipes/wanda-2of4.yaml from another folder
        raise SparsekitError(f"recipe file {recipe} not found: the bundled recipe of that name is --recipe {path.stem}")
    raise SparsekitError(f"recipe {recipe!s} not found: pass a YAML file or one of the bundled recipes: {names} "
                         "(see `sparsekit recipes`)")


def load_recipe(path: str | Path) -> dict[str, Any]:
    """Read a recipe (a file path or a bundled name, see :func:`find_recipe`) into flat settings
    (only the keys it sets)."""
    import yaml

    source = find_recipe(path)
    path = source if isinstance(source, Path) else Path(str(path))  # the name in messages
    try:
        data = yaml.safe_load(source.read_text())
    except yaml.YAMLError as e:
        raise SparsekitError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SparsekitError(f"recipe {path} must be a YAML mapping (method: ..., pattern: ...)")
    _check_keys("the recipe", data, _TOP_KEYS, path)
    out: dict[str, Any] = {}
    for key in ("method", "pattern", "sparsity", "skip", "cats", "allocation", "update", "refine"):
        if key in data:
            out[key] = data[key]
    if isinstance(out.get("pattern"), int):
        raise SparsekitError(f"recipe {path}: pattern {data['pattern']!r} was read as a number: quote it, e.g. pattern: \"2:4\"")
    if "skip" in out:
        skip = out["skip"]
        if skip is None:
            out["skip"] = []
        elif isinstance(skip, str):
            out["skip"] = [skip]
        elif not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
            raise SparsekitError(f"recipe {path}: skip must be a list of module-name patterns")
    sections = [("calibration", _CALIB_KEYS, ""), ("sparsegpt", _SPARSEGPT_KEYS, "")]
    for section, keys, prefix in sections + [(name, keys, f"{name}_") for name, keys in _PREFIXED.items()]:
        sub = data.get(section)
        if sub is None:
            continue
        if not isinstance(sub, dict):
            raise SparsekitError(f"recipe {path}: {section} must be a mapping of {', '.join(sorted(keys))}")
        _check_keys(section, sub, keys, path)
        out.update({prefix + k: v for k, v in sub.items()})
    if not out:
        raise SparsekitError(f"recipe {path} sets nothing (it would run on the defaults): give it some of "
                             f"{', '.join(sorted(_TOP_KEYS - {'description'}))}, or drop --recipe")
    return out


def resolve_settings(recipe: str | Path | None = None, **overrides: Any) -> PruneSettings:
    """Defaults, then the recipe, then every override that is not None; validated."""
    settings = dict(DEFAULTS)
    settings["skip"] = list(DEFAULTS["skip"])
    if recipe is not None:
        settings.update(load_recipe(recipe))
        settings["recipe"] = str(recipe)
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"unknown setting(s): {', '.join(unknown)}")
    for key, value in overrides.items():
        if value is not None:
            if key == "skip":  # one pattern as a plain string is one pattern, not its characters
                value = [value] if isinstance(value, str) else list(value)
            settings[key] = value
    if overrides.get("pattern") is not None and overrides.get("sparsity") is None and recipe is not None:
        from sparsekit.pruning.patterns import Pattern

        if Pattern.parse(str(overrides["pattern"])).is_nm:
            settings["sparsity"] = None  # the recipe's sparsity went with its pattern; N:M fixes its own
    s = validate(settings)
    _check_orphans(s, overrides)
    return s


def _check_orphans(s: PruneSettings, given: dict[str, Any]) -> None:
    """A knob passed for a step the run does not take is most likely a mistake: one line."""
    from sparsekit.pruning.methods import METHODS

    admm = s.update == "admm" or hasattr(METHODS[s.method], "with_iters")
    for keys, used, what in ((("owl_lambda", "owl_m", "owl_windows"), s.allocation == "owl", "--allocation owl"),
                             (("admm_iters",), admm, "--update admm or --method admm"),
                             (("dsnot_cycles",), s.refine == "dsnot", "--refine dsnot")):
        passed = [k for k in keys if given.get(k) is not None]
        if passed and not used:
            flags = ", ".join("--" + k.replace("_", "-") for k in passed)
            raise SparsekitError(f"{flags} go{'es' if len(passed) == 1 else ''} with {what}: add it or drop {flags}")


def _integer(key: str, value: Any) -> int:
    """``value`` as an int, refusing what is not one as written (2.5, true) instead of rounding it."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise SparsekitError(f"{key} must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise SparsekitError(f"{key} must be an integer, got {value!r}") from None


def _number(key: str, value: Any) -> float:
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise SparsekitError(f"{key} must be a number, got {value!r}") from None


def _check_cats(cats: Any, method) -> float | None:
    """The stacked CATS target (``--cats``): None, or an activation sparsity in [0, 1) after a weight method."""
    if cats is None:
        return None
    if not method.changes_weights:
        raise SparsekitError(f"--cats stacks CATS thresholds on a weight method, and {method.name} is CATS itself: "
                             f"drop --cats and pass the activation sparsity with --sparsity")
    try:
        if isinstance(cats, bool):
            raise TypeError
        cats = float(cats)
    except (TypeError, ValueError):
        raise SparsekitError(f"cats must be a number (the activation sparsity, e.g. 0.5), got {cats!r}") from None
    if not 0.0 <= cats < 1.0:
        raise SparsekitError(f"activation sparsity {cats} (--cats) is out of range: use a fraction in [0, 1), e.g. 0.5")
    return cats


def validate(s: dict[str, Any]) -> PruneSettings:
    """Check and normalize raw settings (``DEFAULTS``' keys, plus ``recipe``) into ``PruneSettings``."""
    from sparsekit.hf.data import MIN_SEQLEN
    from sparsekit.pruning.methods import METHODS
    from sparsekit.pruning.patterns import Pattern

    s = dict(s)
    s["method"] = str(s["method"]).lower()
    if s["method"] not in METHODS:
        raise SparsekitError(f"unknown method {s['method']!r}: choose one of {', '.join(METHODS)}")
    method = METHODS[s["method"]]
    pattern = Pattern.parse(str(s["pattern"]))
    method.check_pattern(pattern)
    s["sparsity"] = pattern.resolve_sparsity(s["sparsity"])  # None -> the pattern's default
    s["pattern"] = str(pattern)
    for key, lo in (("nsamples", 1), ("seqlen", MIN_SEQLEN), ("blocksize", 1)):
        s[key] = _integer(key, s[key])
        if s[key] < lo:
            raise SparsekitError(f"{key} must be at least {lo}, got {s[key]}")
    s["seed"] = _integer("seed", s["seed"])
    s["damp"] = _number("damp", s["damp"])
    if not -(2**63) <= s["seed"] < 2**64:  # what torch.Generator.manual_seed accepts
        raise SparsekitError(f"seed {s['seed']} is out of range: use a 64-bit integer, e.g. 0")
    if not 0 < s["damp"] < 1:
        raise SparsekitError(f"damp must be in (0, 1) (a fraction of the mean Hessian diagonal), got {s['damp']}")
    s["skip"] = [str(p) for p in s["skip"]]
    # --skip adds to the default: lm_head stays excluded unless pruning it is asked for by name.
    s["prune_lm_head"] = bool(s.get("prune_lm_head", False))
    if s["prune_lm_head"] and not method.changes_weights:
        raise SparsekitError(f"{method.name} changes no weight, so there is no lm_head to prune: drop --prune-lm-head")
    if s["prune_lm_head"]:
        s["skip"] = [p for p in s["skip"] if p != "lm_head"]
    elif "lm_head" not in s["skip"]:
        s["skip"] = ["lm_head", *s["skip"]]
    s["dataset"] = DEFAULTS["dataset"] if s["dataset"] is None else str(s["dataset"])  # was 'None', a hub id
    s["cats"] = _check_cats(s.get("cats"), method)
    from sparsekit.pruning.learn.allocation import check_allocation

    s["allocation"] = check_allocation(s.get("allocation") or "layer")
    if s["allocation"] == "global" and not pattern.is_hybrid:
        raise SparsekitError(f"--allocation global ranks hybrid tiles across the model: use it with --pattern hybrid[:T], not {pattern}")
    _check_owl(s, method, pattern)
    _check_steps(s, method)
    return PruneSettings(**s)


def _check_owl(s: dict[str, Any], method, pattern) -> None:
    """OWL's settings, normalized in place (checked whatever the allocation: a typo is an error)."""
    from sparsekit.pruning.owl import OwlSettings

    o = OwlSettings(s.get("owl_lambda", DEFAULTS["owl_lambda"]), s.get("owl_m", DEFAULTS["owl_m"]),
                    s.get("owl_windows", DEFAULTS["owl_windows"])).check()
    s["owl_lambda"], s["owl_m"], s["owl_windows"] = o.lam, o.m, o.windows
    if s["allocation"] != "owl":
        return
    if not method.changes_weights:
        raise SparsekitError(f"--allocation owl sets each layer's weight sparsity: use a weight method, not {method.name}")
    if pattern.is_nm:
        raise SparsekitError(f"--allocation owl varies the sparsity per layer, which {pattern} fixes: use an unstructured "
                             "or hybrid pattern")


def _check_steps(s: dict[str, Any], method) -> None:
    """--update / --refine and their iteration counts, normalized in place."""
    for key, allowed in (("update", UPDATES), ("refine", REFINES)):
        v = s.get(key)
        if v is not None:
            v = str(v).strip().lower()
            if v in ("none", ""):
                v = None
            elif v not in allowed:
                raise SparsekitError(f"unknown --{key} {s[key]!r}: use {' or '.join(allowed)} (or leave it out)")
        s[key] = v
        if key == "update" and v is not None and hasattr(method, "with_iters"):
            raise SparsekitError(f"--method {method.name} already updates the weights with ADMM: drop --update")
        if v is not None and not method.changes_weights:
            raise SparsekitError(f"--{key} {v} works on a weight method's mask, and {method.name} changes no weight")
    for key, lo in (("admm_iters", 1), ("dsnot_cycles", 0)):
        v = s.get(key, DEFAULTS[key])
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < lo:
            raise SparsekitError(f"{key.replace('_', ' ')} must be an integer of at least {lo}, got {v!r}")
        s[key] = int(v)
