"""mkdocs hooks: render the torch-style reST roles used in packedinit's docstrings.

packedinit's docstrings follow ``torch.nn.init``'s style (``:math:`...```, ``:class:`~packedinit.Layout```),
which mkdocstrings passes through as text. This hook turns ``:math:`` roles into math (rendered below) and
cross-reference roles into code (linked through mkdocs-autorefs when the target is a packedinit name).

Math is rendered here, at build time, to MathML (``latex2mathml``, pure Python; browsers draw MathML
natively), so the site loads nothing from another host: ``\\( ... \\)`` and ``\\[ ... \\]`` from the
pages (``pymdownx.arithmatex``, generic mode) and ``:math:`` roles from the docstrings alike.
"""

from __future__ import annotations

import html as htmllib
import re
from typing import Any

from latex2mathml.converter import convert

_MATH = re.compile(r":math:<code>(.*?)</code>", re.DOTALL)
_ARITHMATEX = re.compile(
    r'<(span|div) class="arithmatex">\s*(?:\\\(|\\\[)(.*?)(?:\\\)|\\\])\s*</\1>', re.DOTALL
)
_TEXT = re.compile(r"\\text\{[^{}]*\}")
_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|obj|exc):<code>(~?)([^<]*)</code>")


def _xref(m: re.Match[str]) -> str:
    tilde, target = m.group(1), m.group(2)
    text = target.rsplit(".", 1)[-1] if tilde else target
    if target.startswith("packedinit."):
        return f'<autoref identifier="{target}" optional><code>{text}</code></autoref>'
    return f"<code>{text}</code>"


def _mathml(m: re.Match[str]) -> str:
    """One arithmatex span (inline) or div (display) as MathML."""
    tag, tex = m.group(1), htmllib.unescape(m.group(2)).strip()
    tex = _TEXT.sub(lambda t: t.group(0).replace("\\_", "_"), tex)  # latex2mathml keeps "\_" in \text literally
    display = "block" if tag == "div" else "inline"
    return f'<{tag} class="arithmatex">{convert(tex, display=display)}</{tag}>'


def on_page_content(html: str, **kwargs: Any) -> str:
    """Rewrite reST roles and render math in a page's HTML (mkdocs event)."""
    html = _MATH.sub(lambda m: f'<span class="arithmatex">\\({m.group(1)}\\)</span>', html)
    html = _ARITHMATEX.sub(_mathml, html)
    return _ROLE.sub(_xref, html)
