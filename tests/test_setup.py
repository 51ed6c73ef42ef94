"""The README as written is the truth: its test extras carry what the tests import, and `.ci/run`
runs the README's own set-up commands (extracted from README.md, not a copy that can drift)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CI = (ROOT / ".ci" / "run").read_text()
LOCAL = {"packedinit", "benchmarks", "tests", "conftest", "typing_check", "make_figures"}
LOCAL |= {p.stem for p in (ROOT / "tests").glob("_*.py")}  # the tests' private helpers (_dist_worker, _tv_ops, ...)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _extra(name: str) -> set[str]:
    """The distributions an extra of pyproject.toml lists (other extras of packedinit expanded)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    m = re.search(rf"^{name} = \[(.*?)^\]", section, flags=re.DOTALL | re.MULTILINE)
    assert m is not None, name
    out: set[str] = set()
    for req in re.findall(r'"([^"]+)"', m.group(1)):
        inner = re.fullmatch(r"packedinit\[(\w+)\]", req)
        if inner:
            out |= _extra(inner.group(1))
        else:
            dist = re.match(r"[A-Za-z0-9_.\-]+", req)
            assert dist is not None
            out.add(_norm(dist.group(0)))
    return out


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _providers() -> dict[str, list[str]]:
    """``importlib.metadata.packages_distributions()``, also on Python 3.10, where it reads only
    ``top_level.txt`` (which numpy and other meson-built wheels do not ship): there the top-level
    names come from each distribution's file list, as Python 3.11+ does itself."""
    out = {k: list(v) for k, v in importlib.metadata.packages_distributions().items()}
    if sys.version_info < (3, 11):
        for dist in importlib.metadata.distributions():
            for f in dist.files or ():
                top = f.parts[0].removesuffix(".py") if f.parts else ""
                if top.isidentifier() and not f.parts[0].endswith((".dist-info", ".data")):
                    out.setdefault(top, []).append(dist.metadata["Name"])
    return out


def test_the_test_extras_carry_every_package_the_tests_import() -> None:
    """`pip install -e '.[dev]'` then `python -m pytest` (the README's test command) needs nothing else."""
    files = [*ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py"), ROOT / "docs" / "scripts" / "make_figures.py"]
    third_party = set().union(*(_imported_modules(f) for f in files)) - LOCAL - set(sys.stdlib_module_names)
    third_party -= {"tomllib"}  # stdlib from Python 3.11 (on 3.10 the tests read pyproject with tomli, a test extra)
    providers = _providers()
    needed = {_norm(providers[m][0]) for m in third_party if m != "torch"}
    assert "matplotlib" in needed  # the figure scripts the docs tests run
    assert needed - _extra("dev") == set()
    assert _extra("test") <= _extra("dev")


def _snippet(marker: str) -> str:
    """The Python heredoc that follows ``marker`` in .ci/run."""
    m = re.search(re.escape(marker) + r" <<'PY'\n(.*?)^PY$", CI, flags=re.DOTALL | re.MULTILINE)
    assert m is not None, marker
    return m.group(1)


def _readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Set-up commands\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```bash\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)


def test_ci_extracts_the_readme_commands_verbatim_and_runs_them(tmp_path: Path) -> None:
    blocks = _readme_blocks()
    assert len(blocks) == 2
    main_job, tests = (b.strip() for b in blocks)
    assert main_job.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0")
    assert main_job.endswith("python -m packedinit audit")
    assert "pip install -e '.[dev]'" in tests
    assert tests.endswith("python -m pytest")
    code = _snippet('python3 - README.md "$work"')
    argv = [sys.executable, "-c", code, str(ROOT / "README.md"), str(tmp_path)]
    subprocess.run(argv, check=True, capture_output=True)
    assert (tmp_path / "main.sh").read_text() == blocks[0]
    assert (tmp_path / "tests.sh").read_text() == blocks[1]
    # CI runs both files, the test command before any other install of the project
    assert 'bash -e "$work/main.sh"' in CI
    assert 'bash -e "$work/tests.sh"' in CI
    assert CI.index('bash -e "$work/tests.sh"') < CI.index("pip install -q -e '.[dev,docs]'")


@pytest.mark.parametrize(
    ("tests", "failures", "passes"), [(0, 0, False), (12, 0, True), (12, 1, False)], ids=["none", "green", "red"]
)
def test_ci_fails_when_pytest_ran_no_test(tmp_path: Path, tests: int, failures: int, passes: bool) -> None:
    code = _snippet('python3 - "$work/junit.xml"')
    xml = tmp_path / "junit.xml"
    xml.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" '
        f'errors="0" skipped="0"/></testsuites>'
    )
    rc = subprocess.run([sys.executable, "-c", code, str(xml)], capture_output=True).returncode
    assert (rc == 0) is passes


def test_the_library_tests_libraries_are_installed_by_ci() -> None:
    """Every library tests/test_libs_*.py loads (``lib("...")``) is in the ``libs`` extra or .ci/libs.txt, and
    .ci/run runs .ci/libs, which installs both and runs those files with a missing library failing."""
    loaded = set()
    for path in ROOT.glob("tests/test_libs_*.py"):
        loaded |= {m.split(".")[0] for m in re.findall(r'lib\("([\w.]+)"\)', path.read_text())}
    assert loaded == {"timm", "torchtitan", "diffusers", "open_clip", "torchrl", "x_transformers"}
    pinned = {
        _norm(line.split("==")[0])
        for line in (ROOT / ".ci" / "libs.txt").read_text().splitlines()
        if line and not line.startswith("#")
    }
    distribution = {"open_clip": "open-clip-torch", "x_transformers": "x-transformers"}
    assert {_norm(distribution.get(m, m)) for m in loaded} <= _extra("libs") | pinned
    libs = (ROOT / ".ci" / "libs").read_text()
    assert "bash .ci/libs" in CI
    assert "-e '.[test,libs]'" in libs
    assert "--no-deps -r .ci/libs.txt" in libs
    assert "PACKEDINIT_REQUIRE_LIBS=1" in libs
    assert "tests/test_libs_*.py" in libs
