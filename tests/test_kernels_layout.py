"""The kernels package's layout: each device-primitive module has a simulator and a PTX half that
export the same names, and the chooser takes one of them whole."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
PAIRS = [("_intrinsics_sim.py", "_intrinsics_ptx.py"), ("_warp_intrinsics_sim.py", "_warp_intrinsics_ptx.py"),
         ("_rows_intrinsics_sim.py", "_rows_intrinsics_ptx.py"), ("_sp_intrinsics_sim.py", "_sp_intrinsics_ptx.py"),
         ("_wg_intrinsics_sim.py", "_wg_intrinsics_ptx.py")]


def exported(path: Path) -> tuple[set, set, set]:
    """(``__all__``, the public names defined at module level, every name defined at module level)."""
    tree = ast.parse(path.read_text())
    all_names, defined = None, set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    if t.id == "__all__":
                        all_names = set(ast.literal_eval(node.value))
                    else:
                        defined.add(t.id)
    assert all_names is not None, f"{path.name} has no __all__"
    return all_names, {n for n in defined if not n.startswith("_")}, defined


def check_pair(sim: Path, ptx: Path) -> None:
    sim_all, sim_public, sim_defined = exported(sim)
    ptx_all, ptx_public, ptx_defined = exported(ptx)
    assert sim_all == ptx_all, f"only in {sim.name}: {sim_all - ptx_all}; only in {ptx.name}: {ptx_all - sim_all}"
    for path, names, public, defined in ((sim, sim_all, sim_public, sim_defined),
                                         (ptx, ptx_all, ptx_public, ptx_defined)):
        assert names <= defined, f"{path.name}: __all__ names not defined: {names - defined}"
        assert public <= names, f"{path.name}: public names missing from __all__: {public - names}"


@pytest.mark.parametrize("sim,ptx", PAIRS)
def test_halves_export_the_same_names(sim, ptx):
    check_pair(KERNELS / sim, KERNELS / ptx)


def test_check_catches_a_name_in_one_half(tmp_path):
    """The check above fails when a primitive is added to one half only (exported or not)."""
    sim, ptx = (tmp_path / n for n in PAIRS[0])
    src_sim = (KERNELS / PAIRS[0][0]).read_text()
    ptx.write_text((KERNELS / PAIRS[0][1]).read_text())
    sim.write_text(src_sim + "\n\ndef extra():\n    pass\n")                  # defined, not exported
    with pytest.raises(AssertionError, match="missing from __all__"):
        check_pair(sim, ptx)
    sim.write_text(src_sim.replace('__all__ = [', '__all__ = ["extra", ') + "\n\ndef extra():\n    pass\n")
    with pytest.raises(AssertionError, match="only in"):
        check_pair(sim, ptx)


def test_active_half_matches_the_chooser():
    """``_intrinsics`` / ``_warp_intrinsics`` / ``_rows_intrinsics`` / ``_sp_intrinsics`` / ``_wg_intrinsics``
    re-export the whole active half."""
    import importlib

    from sparsekit.kernels.common import SIM

    choosers = ("_intrinsics", "_warp_intrinsics", "_rows_intrinsics", "_sp_intrinsics", "_wg_intrinsics")
    for chooser, (sim, ptx) in zip(choosers, PAIRS, strict=True):
        mod = importlib.import_module(f"sparsekit.kernels.{chooser}")
        half = importlib.import_module(f"sparsekit.kernels.{(sim if SIM else ptx)[:-3]}")
        assert all(getattr(mod, n) is getattr(half, n) for n in half.__all__)


def test_scripts_and_tests_use_no_private_sparsekit_names():
    """Scripts and tests reach sparsekit (kernels included) only through public names: no private module
    either (``sparsekit.kernels._intrinsics``). Every script and test file is checked (a list of
    names here skipped one that had been renamed)."""
    root = KERNELS.parent
    files = sorted((root / "scripts").rglob("*.py")) + sorted((root / "tests").glob("*.py"))
    assert len(files) > 40
    bad = []
    for f in files:
        tree = ast.parse(f.read_text())
        modules = {}   # local name -> sparsekit module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparsekit"):
                parts = node.module.split(".")
                bad += [f"{f.name}: {node.module}" for p in parts if p.startswith("_")]
                for a in node.names:
                    if a.name.startswith("_"):
                        bad.append(f"{f.name}: {node.module}.{a.name}")
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("sparsekit") and any(p.startswith("_") for p in a.name.split(".")):
                        bad.append(f"{f.name}: {a.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_")):
                bad.append(f"{f.name}: {modules[node.value.id]}.{node.attr}")
    assert not bad, bad
