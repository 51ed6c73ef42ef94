"""The package's shape: no `_private` name crosses a module boundary, no module grows past 400 lines,
and the layers of pyproject.toml's import-linter contract list every module (so a new one cannot skip them)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 needs tomli to read pyproject.toml")

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "packedinit"
MODULES = sorted(p for p in PKG.rglob("*.py"))
MAX_LINES = 400


def _imports(path: Path) -> list[tuple[int, str, str]]:
    out: list[tuple[int, str, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("packedinit")):
            out += [(node.lineno, node.module or ".", a.name) for a in node.names]
    return out


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PKG).as_posix())
def test_no_private_name_is_imported_from_another_module(path: Path) -> None:
    imports = _imports(path)
    private = [(n, m, name) for n, m, name in imports if name.startswith("_") and not name.endswith("__")]
    bad = [f"{path.name}:{n} from {m} import {name}" for n, m, name in private]
    assert not bad, bad


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PKG).as_posix())
def test_modules_stay_small(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path.name}: split it by job"


def test_the_layer_contract_names_every_module() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    layers = {name.split("#")[0].strip() for layer in contract["layers"] for name in layer.split("|")}
    top = {p.stem for p in PKG.glob("*.py")} | {p.parent.name for p in PKG.glob("*/__init__.py")}
    top -= {"__init__", "__main__"}
    assert top == layers, f"unlisted: {sorted(top - layers)}; stale: {sorted(layers - top)}"


def test_the_engine_page_lists_every_module() -> None:
    """docs/pages/engine.md's module table names every module of the tree, and nothing else."""
    page = (ROOT / "docs" / "pages" / "engine.md").read_text()
    table = page.split("| module | job |", 1)[1].split("\n\n", 1)[0]
    listed = {name for row in table.splitlines()[2:] for name in re.findall(r"`([a-z_/]+)`", row.split(" | ")[0])}
    tree = {
        p.relative_to(PKG).with_suffix("").as_posix()
        for p in PKG.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    assert listed == tree, f"not in the table: {sorted(tree - listed)}; not in the tree: {sorted(listed - tree)}"


def test_documented_import_paths_keep_working() -> None:
    """The paths the docs show import, and name the same objects as the rooms that hold the code."""
    import packedinit
    import packedinit.audit as audit_module
    from packedinit.auditing import measure, stats
    from packedinit.claims import annotations_of
    from packedinit.distributed import global_params
    from packedinit.engine import distributed
    from packedinit.model import claims
    from packedinit.recipes import torch_defaults
    from packedinit.torch_defaults import TorchDefaultsFix, torch_defaults_fixed

    assert audit_module is packedinit.audit
    assert callable(audit_module)
    assert audit_module.DEFAULT_REFERENCES is stats.DEFAULT_REFERENCES
    assert audit_module.audit is measure.audit
    assert annotations_of is claims.annotations_of
    assert global_params is distributed.global_params
    assert TorchDefaultsFix is torch_defaults.TorchDefaultsFix
    assert torch_defaults_fixed is torch_defaults.torch_defaults_fixed
