"""The package's shape: no `_private` name crosses a module boundary, no module grows past ~500 lines,
and the layers of pyproject.toml's import-linter contract list every module (so a new one cannot skip them)."""

from __future__ import annotations

import ast
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
MAX_LINES = 560


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
    (contract,) = config["tool"]["importlinter"]["contracts"]
    layers = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    top = {p.stem for p in PKG.glob("*.py")} | {p.parent.name for p in PKG.glob("*/__init__.py")}
    top -= {"__init__", "__main__"}
    assert top == layers, f"unlisted: {sorted(top - layers)}; stale: {sorted(layers - top)}"
