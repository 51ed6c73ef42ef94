"""The facts a library dependency needs agree with each other: the licence, the changelog, the Python
and torch versions (pyproject, README, classifiers, the compat step, .ci/compat), and what the sdist ships."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import packedinit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 needs tomli to read pyproject.toml")

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CI = (ROOT / ".ci" / "compat").read_text()
README = (ROOT / "README.md").read_text()


def _compat_pairs() -> list[tuple[str, str]]:
    """The (Python, torch) pairs .ci/run's compat step runs the suite on, in order."""
    return re.findall(r"^compat (3\.\d+) (\d+\.\d+\.\d+)$", CI, flags=re.MULTILINE)


def _minor(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int(minor)


def test_the_licence_file_is_the_one_pyproject_names() -> None:
    assert PROJECT["license"] == "BSD-3-Clause"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License\n")
    assert re.search(r"^Copyright \(c\) \d{4}, the packedinit authors$", text, flags=re.MULTILINE)
    assert "Neither the name of the copyright holder nor the names of its" in text  # the third clause


def test_the_changelog_has_the_current_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert PROJECT["version"] == packedinit.__version__
    assert re.search(rf"^## \[{re.escape(packedinit.__version__)}\]", text, flags=re.MULTILINE)


def test_python_versions_agree_across_pyproject_classifiers_readme_and_ci() -> None:
    floor = re.fullmatch(r">=(3\.\d+)", PROJECT["requires-python"])
    assert floor is not None
    pairs = _compat_pairs()
    assert len(pairs) == 2, pairs
    (oldest_py, _), (newest_py, _) = pairs
    assert oldest_py == floor.group(1), "the compat step's oldest Python is requires-python's floor"
    lo, hi = _minor(oldest_py)[1], _minor(newest_py)[1]
    listed = {c.rsplit(" ", 1)[1] for c in PROJECT["classifiers"] if re.fullmatch(r".*Python :: 3\.\d+", c)}
    assert listed == {f"3.{m}" for m in range(lo, hi + 1)}
    words = ", ".join(f"3.{m}" for m in range(lo, hi)) + f" and 3.{hi}"
    assert f"Python {words}" in README


def test_the_torch_floor_is_the_oldest_torch_ci_runs() -> None:
    (dep,) = [d for d in PROJECT["dependencies"] if re.match(r"torch\b", d)]
    floor = re.fullmatch(r"torch>=(\d+\.\d+)", dep)
    assert floor is not None, dep
    (_, oldest), (_, newest) = _compat_pairs()
    assert _minor(oldest) == _minor(floor.group(1)), "the compat step runs the floor pyproject promises"
    assert _minor(oldest) < _minor(newest)
    span = f"torch {floor.group(1)} to {'.'.join(map(str, _minor(newest)))}"
    assert span in README, span
    assert f"torch {oldest} with" in README
    assert f"torch {newest} with" in README


def test_the_sdist_ships_what_the_tests_read() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = {p.lstrip("/") for p in config["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]}
    read_by_tests = {"packedinit", "tests", "docs", "benchmarks", ".ci", "README.md", "pyproject.toml"}
    assert read_by_tests - {"pyproject.toml"} <= include  # hatch always ships pyproject.toml
    assert {"LICENSE", "CHANGELOG.md"} <= include
    for name in read_by_tests:
        assert (ROOT / name).exists(), name
