"""Words of the command line's messages: text shortened to one line, and did-you-mean suggestions."""

from __future__ import annotations

import difflib
import pkgutil
import sys
from collections.abc import Iterable, Sequence

__all__ = ["shorten", "clip", "did_you_mean", "closest", "suggestion", "module_hint"]


def shorten(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut in the middle when longer than ``limit`` characters (error messages stay one short line).

    Examples:
        >>> shorten("[" * 1000, limit=20)
        "'[[[[[[...[[[[[[' (1000 characters)"
    """
    r = repr(text)
    if len(r) <= limit:
        return r
    half = (limit - 6) // 2
    return f"{r[:half]}...{r[-half:]} ({len(text)} characters)"


def clip(e: BaseException, limit: int = 200) -> str:
    """An exception's message on one line, at most ``limit`` characters."""
    msg = " ".join(str(e).split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``" (did you mean 'a' or 'b'?)"`` for the closest candidates; ``""`` when none is close.

    Prefix matches come first (``xavier`` -> ``xavier_uniform_``), then :mod:`difflib` ones.
    Names starting with ``_`` are offered only when ``word`` does.

    Examples:
        >>> did_you_mean("n_layr", ["n_layer", "n_head", "n_embd"])
        " (did you mean 'n_layer'?)"
        >>> did_you_mean("xavier", ["xavier_uniform_", "xavier_normal_", "zeros_"])
        " (did you mean 'xavier_normal_' or 'xavier_uniform_'?)"
        >>> did_you_mean("zzz", ["n_layer"])
        ''
    """
    return suggestion(closest(word, candidates))


def closest(word: str, candidates: Iterable[str]) -> list[str]:
    """Up to three candidates close to ``word``: prefix matches first, then :mod:`difflib` ones.

    Examples:
        >>> closest("Linaer", ["Linear", "Bilinear", "LSTM"])
        ['Linear']
    """
    pool = sorted({c for c in candidates if word.startswith("_") or not c.startswith("_")})
    prefix = [c for c in pool if word and c.startswith(word) and c != word]
    close = difflib.get_close_matches(word, pool, n=3, cutoff=0.75)
    return list(dict.fromkeys(prefix[:3] + close))[:3]


def suggestion(best: Sequence[str]) -> str:
    """``" (did you mean 'a' or 'b'?)"`` for ``best``; ``""`` when it is empty."""
    return " (did you mean " + " or ".join(repr(b) for b in best) + "?)" if best else ""


def module_hint(missing: str) -> str:
    """Did-you-mean for a module that is not there: its siblings in the parent package (or top-level modules)."""
    parent, _, leaf = missing.rpartition(".")
    try:
        path = getattr(sys.modules[parent], "__path__", None) if parent else None
        names = [m.name for m in pkgutil.iter_modules(path)] if not parent or path is not None else []
    except Exception:  # an odd package: no suggestion
        names = []
    return suggestion([f"{parent}.{n}" if parent else n for n in closest(leaf, names)])
