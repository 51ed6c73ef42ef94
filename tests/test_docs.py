"""The documentation site: every nav page exists, the pages' code runs, shown outputs are current,
and the figure script reproduces the numbers the problem page quotes."""

from __future__ import annotations

import importlib.util
import io
import math
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML ships no type stubs

from packedinit.cli.command import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = DOCS / "pages"


def _nav_files(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [f for item in node for f in _nav_files(item)]
    if isinstance(node, dict):
        return [f for v in node.values() for f in _nav_files(v)]
    return []


def test_every_nav_page_exists_and_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((DOCS / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "pages"
    nav = _nav_files(config["nav"])
    assert len(nav) == len(set(nav))
    for page in nav:
        assert (PAGES / page).is_file(), page
    on_disk = {p.relative_to(PAGES).as_posix() for p in PAGES.rglob("*.md")}
    assert on_disk == set(nav)
    assert (PAGES / "img" / "per_block_std.png").is_file()


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (PAGES / page).read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("page", ["index.md", "problem.md", "quickstart.md", "cli.md", "audit.md", "fingerprint.md"])
def test_code_blocks_run(page: str, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = _python_blocks(page)
    assert blocks, page
    for code in blocks:
        exec(compile(code, f"{page}", "exec"), {"__name__": "__docs__"})  # our own pages' examples
    out = capsys.readouterr().out
    if page == "quickstart.md":
        assert "self_attn.in_proj_weight Layout(dim=0, sizes=(32, 32, 32), names=('q', 'k', 'v'))" in out
        assert "packed: xavier (per-block std would be 1.41x); decided by std" in out
        assert "affected: 1 packed parameter initialised whole (in_proj_weight)" in out
        assert out.rstrip().endswith("per-block")


def _shown_output(command: str) -> str:
    text = (PAGES / "cli.md").read_text()
    m = re.search(r"```text\n\$ " + re.escape(command) + r"\n(.*?)```", text, flags=re.DOTALL)
    assert m is not None, command
    return m.group(1)


@pytest.mark.parametrize(
    "command",
    ["python -m packedinit audit", "python -m packedinit audit torch.nn:MultiheadAttention embed_dim=64 num_heads=4"],
)
def test_cli_page_shows_the_current_output(command: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert main(command.split()[3:], stdout=out, stderr=err) == 0
    assert _shown_output(command) == out.getvalue()


def _load_figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_figures", DOCS / "scripts" / "make_figures.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def test_figure_numbers_match_the_maths_and_the_page(tmp_path: Path) -> None:
    figures = _load_figures()
    cases = figures.figure_data(0)
    theory = [
        [1 / math.sqrt(2)] * 3,  # MHA: sqrt((E + E) / (3E + E))
        [math.sqrt((256 + 128) / (4 * 256 + 128))] * 4,  # LSTM ih, xavier
        [0.5] * 4,  # LSTM hh, orthogonal: sqrt(H / 4H)
        [math.sqrt(512 / 640), math.sqrt(320 / 640), math.sqrt(320 / 640)],  # GQA, xavier
    ]
    page = (PAGES / "problem.md").read_text()
    for case, expected in zip(cases, theory, strict=True):
        assert case.before == pytest.approx(expected, rel=0.03)
        assert case.after == pytest.approx([1.0] * len(expected), rel=0.03)
        if len(set(round(r, 2) for r in case.before)) > 1:
            assert ", ".join(f"{r:.2f}" for r in case.before) in page
    path = figures.make_figure(tmp_path, 0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
