"""The built site: the API page as mkdocstrings renders it (every heading has words under it, no object documented
twice), and every page self-contained (nothing loaded from another host, math rendered at build time).

The site is built once with ``mkdocs build --strict`` (about 5 s) and the API page's HTML is read
back: each documented object is a ``div.doc-object`` whose heading id is the object's path.
"""

from __future__ import annotations

import importlib
import itertools
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

import packedinit

ROOT = Path(__file__).resolve().parent.parent
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def text(self, skip: tuple[str, ...] = ()) -> str:
        parts: list[str] = []
        for c in self.children:
            if isinstance(c, str):
                parts.append(c)
            elif not (c.classes & set(skip)):
                parts.append(c.text(skip))
        return " ".join(" ".join(parts).split())

    def walk(self) -> list[Node]:
        found = [self]
        for c in self.children:
            if isinstance(c, Node):
                found += c.walk()
        return found


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built once (``mkdocs build --strict``) for this module's tests."""
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", "docs/mkdocs.yml", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return site


def _parse(path: Path) -> Node:
    builder = _TreeBuilder()
    builder.feed(path.read_text())
    return builder.root


@pytest.fixture(scope="module")
def api_page(site: Path) -> Node:
    builder = _TreeBuilder()
    builder.feed((site / "api" / "index.html").read_text())
    article = next(n for n in builder.root.walk() if n.tag == "article")
    return article


def _heading(obj: Node) -> Node | None:
    return next((c for c in obj.children if isinstance(c, Node) and re.fullmatch(r"h[1-6]", c.tag)), None)


def _objects(page: Node) -> list[tuple[str, Node]]:
    """``(heading id, div)`` of every documented object with a heading (the package itself has none)."""
    found = []
    for n in page.walk():
        h = _heading(n) if {"doc", "doc-object"} <= n.classes else None
        if h is not None:
            found.append((h.attrs["id"], n))
    return found


def _identity(path: str) -> tuple[int, str]:
    """Who a heading id names: ``(id(class), member)`` for a class member, ``(id(object), "")`` otherwise.

    ``packedinit.audit.audit`` is the function in the module; ``packedinit.ParamAudit`` and
    ``packedinit.audit.ParamAudit`` are one object, and so are their members.
    """
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:-1] if i < len(parts) else ():
            obj = getattr(obj, p)
        if i == len(parts):
            return id(obj), ""
        if isinstance(obj, type):
            return id(obj), parts[-1]  # a method, property or field (a bare field has no class attribute)
        return id(getattr(obj, parts[-1])), ""
    raise AssertionError(path)


def test_every_documented_object_has_words_under_its_heading(api_page: Node) -> None:
    objects = _objects(api_page)
    assert len(objects) > 40
    empty = []
    for path, obj in objects:
        contents = next(c for c in obj.children if isinstance(c, Node) and "doc-contents" in c.classes)
        if not contents.text(skip=("doc-children", "doc-signature", "doc-attribute-value")):
            empty.append(path)
    assert empty == []


def test_every_section_heading_has_words_before_the_next_heading(api_page: Node) -> None:
    content = [c for c in api_page.children if isinstance(c, Node) or c.strip()]
    empty = []
    for a, b in itertools.pairwise(content):
        if (
            isinstance(a, Node)
            and isinstance(b, Node)
            and re.fullmatch(r"h[1-6]", a.tag)
            and (re.fullmatch(r"h[1-6]", b.tag) or {"doc", "doc-object"} <= b.classes)
        ):
            empty.append(a.text())
    assert empty == []


def test_no_object_is_documented_twice(api_page: Node) -> None:
    ids = [path for path, _ in _objects(api_page)]
    assert len(ids) == len(set(ids))
    seen: dict[tuple[int, str], str] = {}
    twice = []
    for path in ids:
        key = _identity(path)
        if key in seen:
            twice.append((seen[key], path))
        seen[key] = path
    assert twice == []


def test_every_public_name_is_on_the_page(api_page: Node) -> None:
    ids = {path for path, _ in _objects(api_page)}
    anchors = {n.attrs["id"] for n in api_page.walk() if "id" in n.attrs}
    missing = [name for name in packedinit.__all__ if f"packedinit.{name}" not in ids | anchors]
    assert missing == ["audit"]  # packedinit.audit is the submodule's name here; the function is below
    assert "packedinit.audit.audit" in ids
    for name in ("main", "affected", "json_safe"):
        assert f"packedinit.cli.command.{name}" in ids
    for name in ("Target", "parse_target", "parse_init", "parse_seed", "build_target"):
        assert f"packedinit.cli.parse.{name}" in ids


#: Tags whose ``src``/``href``/``data`` the browser loads (an ``<a href>`` is a link the reader may follow).
_LOADED = {
    "script": "src",
    "link": "href",
    "img": "src",
    "source": "src",
    "iframe": "src",
    "video": "src",
    "audio": "src",
    "embed": "src",
    "object": "data",
    "track": "src",
    "input": "src",
}
_EXTERNAL = re.compile(r"^\s*(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)
_CSS_URL = re.compile(r"""(?:url\(\s*["']?|@import\s+["'])\s*((?:[a-z][a-z0-9+.-]*:)?//[^"')\s]+)""", re.IGNORECASE)


def test_the_site_loads_nothing_from_another_host(site: Path) -> None:
    """No script, style, font, image or frame from another host: the site works with no network."""
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 10
    bad: list[str] = []
    for page in pages:
        for n in _parse(page).walk():
            attr = _LOADED.get(n.tag)
            for name in (attr, "srcset") if attr else ("srcset",):
                value = n.attrs.get(name, "")
                if any(_EXTERNAL.match(v.split()[0]) for v in value.split(",") if v.strip()):
                    bad.append(f"{page.relative_to(site)}: <{n.tag} {name}={value!r}>")
            if n.tag == "style" or "style" in n.attrs:
                css = n.attrs.get("style", "") + " ".join(c for c in n.children if isinstance(c, str))
                bad += [f"{page.relative_to(site)}: <{n.tag}> css {u}" for u in _CSS_URL.findall(css)]
    for sheet in site.rglob("*.css"):
        bad += [f"{sheet.relative_to(site)}: {u}" for u in _CSS_URL.findall(sheet.read_text(errors="replace"))]
    assert not bad, bad


def _visible_text(node: Node) -> str:
    """Text outside code, pre and math: what the reader sees as prose."""
    if node.tag in ("code", "pre", "math", "script", "style"):
        return ""
    return " ".join(c if isinstance(c, str) else _visible_text(c) for c in node.children)


@pytest.mark.parametrize("page", ["index.html", "problem/index.html", "audit/index.html", "api/index.html"])
def test_math_is_rendered_at_build_time(site: Path, page: str) -> None:
    """Every formula is MathML in the HTML: no raw TeX left for a script from a CDN to typeset."""
    root = _parse(site / page)
    spans = [n for n in root.walk() if "arithmatex" in n.classes]
    assert spans, page
    assert all(any(c.tag == "math" for c in n.children if isinstance(c, Node)) for n in spans), page
    maths = [n for n in root.walk() if n.tag == "math"]
    assert not [m.text() for m in maths if "\\" in m.text()], page  # no TeX escape (\_, \sqrt) left inside
    text = _visible_text(root)
    raw = re.findall(r"\\[(\[)\]]|:math:|\\(?:sqrt|frac|mathcal|kappa)\b", text)
    assert not raw, (page, raw[:5])
