"""The "Which call do I use" table (README and docs index) says what each call changes, as measured."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("which_call", ROOT / "docs" / "scripts" / "which_call.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def measured() -> tuple[dict[str, list[str]], int]:
    script = _script()
    return script.measure(), script.total()


def _rows(path: Path) -> list[tuple[str, int, int]]:
    """``(call cell, changed, total)`` for each row of the page's table, in order."""
    section = path.read_text().split("## Which call do I use", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    out = []
    for row in rows:
        m = re.search(r"\| (\d+) of (\d+) tensors", row)
        assert m, row
        out.append((row.split(" | ")[0], int(m.group(1)), int(m.group(2))))
    return out


@pytest.mark.parametrize("page", ["README.md", "docs/pages/index.md"])
def test_the_table_gives_the_measured_counts_narrowest_first(
    page: str, measured: tuple[dict[str, list[str]], int]
) -> None:
    changed, total = measured
    rows = _rows(ROOT / page)
    assert [r[0].split("`")[1].split("(")[0] for r in rows] == [
        "packedinit.init_model",
        "with packedinit.fix_torch_defaults",
        "packedinit.reset_parameters",
        "packedinit.chunked",
    ]
    assert all(r[2] == total for r in rows)
    expected = [len(changed[k]) for k in ("audit fix", "fix_torch_defaults", "reset_parameters", "chunked(f)(model)")]
    assert [r[1] for r in rows] == expected
    assert expected[0] <= expected[1] <= expected[3]  # narrowest first (reset redraws; chunked replaces)


def test_what_the_script_measures(measured: tuple[dict[str, list[str]], int]) -> None:
    changed, total = measured
    packed = ["layers.0.self_attn.in_proj_weight", "layers.1.self_attn.in_proj_weight"]
    assert changed["audit fix"] == packed  # the audit's fix changes exactly what it names
    assert changed["fix_torch_defaults"] == packed  # the rest is torch's construction, bit for bit
    assert changed["chunked(f)(model)"] == changed["init_model(model, f)"]  # one job, two spellings
    assert set(packed) < set(changed["chunked(f)(model)"]) <= set(changed["reset_parameters"])
    assert total == 24
