"""mkdocs hooks: render the torch-style reST roles used in packedinit's docstrings.

packedinit's docstrings follow ``torch.nn.init``'s style (``:math:`...```, ``:class:`~packedinit.Layout```),
which mkdocstrings passes through as text. This hook turns ``:math:`` roles into MathJax spans and
cross-reference roles into code (linked through mkdocs-autorefs when the target is a packedinit name).
"""

from __future__ import annotations

import re
from typing import Any

_MATH = re.compile(r":math:<code>(.*?)</code>", re.DOTALL)
_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|obj|exc):<code>(~?)([^<]*)</code>")


def _xref(m: re.Match[str]) -> str:
    tilde, target = m.group(1), m.group(2)
    text = target.rsplit(".", 1)[-1] if tilde else target
    if target.startswith("packedinit."):
        return f'<autoref identifier="{target}" optional><code>{text}</code></autoref>'
    return f"<code>{text}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    """Rewrite reST roles in a page's HTML (mkdocs event)."""
    html = _MATH.sub(lambda m: f'<span class="arithmatex">\\({m.group(1)}\\)</span>', html)
    return _ROLE.sub(_xref, html)
