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


def _tp_section() -> str:
    page = (PAGES / "distributed.md").read_text()
    return page.split("## Fans from a local shard (tensor parallel)", 1)[1].split("\n## ", 1)[0]


def test_tp_fan_section_runs_and_shows_its_output(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/pages/distributed.md, "Fans from a local shard": its single-process blocks print what it shows."""
    section = _tp_section()
    ns: dict[str, Any] = {"__name__": "__docs__"}
    for code in re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL):
        exec(compile(code, "distributed.md", "exec"), ns)  # our own page's examples, in order
    shown = re.findall(r"```text\n(.*?)```", section, flags=re.DOTALL)
    assert capsys.readouterr().out == "".join(shown[:2])  # the last text block is the torchrun script's


@pytest.mark.slow
def test_tp_fan_section_script_runs_on_two_gloo_ranks(tmp_path: Path) -> None:
    """The section's ``tp_fans.py``, launched as the page says (torchrun, 2 processes, gloo), prints what it shows."""
    import os
    import subprocess

    section = _tp_section()
    assert "torchrun --standalone --nproc-per-node 2 tp_fans.py" in section
    [script] = re.findall(r'```python title="tp_fans.py"\n(.*?)```', section, flags=re.DOTALL)
    (tmp_path / "tp_fans.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "tp_fans.py"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    # torch 2.13's gloo may abort at interpreter exit after destroy_process_group (see test_docs_flows.py)
    assert run.returncode == 0 or "terminate called without an active exception" in run.stderr, run.stderr[-3000:]
    shown = re.findall(r"```text\n(.*?)```", section, flags=re.DOTALL)[-1]
    assert shown.strip() in run.stdout


#: This project's own issue numbers ("issue 12", "issue23", "#17"); another project's (pytorch/pytorch#166378,
#: a github.com/.../issues/N link) are references a reader can follow.
_OWN_ISSUE = re.compile(r"\bissues? ?#?\d+|(?<![\w/])#\d+\b", re.IGNORECASE)


@pytest.mark.parametrize("path", ["README.md", *sorted(p.name for p in PAGES.glob("*.md"))])
def test_user_docs_speak_of_no_internal_issue_numbers(path: str) -> None:
    text = (ROOT / path if path == "README.md" else PAGES / path).read_text()
    found = [m.group(0) for m in _OWN_ISSUE.finditer(text)]
    assert not found, f"{path}: say what changed instead of {found[:5]}"


def _library_blocks() -> list[Any]:
    """libraries.md's snippets, one per library: (the library it imports besides torch and packedinit, the code)."""
    params = []
    for code in _python_blocks("libraries.md"):
        names = {m for m in re.findall(r"^(?:import|from) (\w+)", code, flags=re.MULTILINE)} - {"torch", "packedinit"}
        assert len(names) == 1, code
        library = names.pop()
        params.append(pytest.param(library, code, id=library))
    return params


@pytest.mark.parametrize(("library", "code"), _library_blocks())
def test_libraries_page_snippets_run(library: str, code: str, lib: Any) -> None:
    """Each library's snippet runs where the library is installed (.ci/libs), and skips, naming it, elsewhere."""
    for module in re.findall(r"^(?:import|from) ([\w.]+)", code, flags=re.MULTILINE):
        if module.split(".")[0] == library:  # imported first, through the torchvision shim, its import warnings
            lib(module)  # silenced; the snippet's own import then finds it
    exec(compile(code, "libraries.md", "exec"), {"__name__": "__docs__"})  # our own page's example


def test_libraries_page_has_one_snippet_per_library() -> None:
    assert [p.values[0] for p in _library_blocks()] == ["timm", "torchtitan", "diffusers", "open_clip", "torchrl"]
