"""Keyword typos in the whole-model calls, caught before the init function is called.

``init_model(model, f, module=nn.Linear)`` (meant ``modules=``) would otherwise reach ``f`` as
a keyword ``f`` does not take, and the message would blame ``f``. Here a keyword that ``f``'s
signature refuses and that is close to one of the call's own keywords (or to one of ``f``'s)
gets "did you mean ...?" before anything runs.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from packedinit.engine.traits import fn_name
from packedinit.errors import PackedInitTypeError

__all__ = ["check_keywords", "FILTERS"]

#: ``init_model``'s own keywords: the filters.
FILTERS: tuple[str, ...] = ("modules", "params")


def _taken(fn: object) -> tuple[str, ...] | None:
    """The keyword names ``fn(tensor, ...)`` takes; ``None`` when it takes any (``**kwargs``) or cannot be read."""
    try:
        sig = inspect.signature(fn)  # type: ignore[arg-type]  # any callable; failures handled below
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in params[1:] if p.kind in keyword_kinds)


def _functions(init_fn: object) -> list[object]:
    """The callables of an init spec: the function, or those of a per-block list or mapping."""
    if callable(init_fn):
        return [init_fn]
    values: Sequence[object] = ()
    if isinstance(init_fn, Mapping):
        values = list(init_fn.values())
    elif isinstance(init_fn, Sequence) and not isinstance(init_fn, (str, bytes)):
        values = init_fn
    return [f for f in values if callable(f)]


def check_keywords(call: str, own: Sequence[str], init_fn: object, kwargs: Mapping[str, Any]) -> None:
    """Raise for a keyword in ``kwargs`` that an init function refuses and that looks like a typo.

    ``call`` names the public call in the message (``"init_model"``); ``own`` are its own
    keywords (those it does not forward). A keyword that every readable signature takes, or one
    with no close name, is left for the init function to judge, as before.

    Raises:
        PackedInitTypeError: the keyword is refused and close to ``own`` or to the function's
            own keywords; or it is one of :data:`FILTERS`, given to a call that has no filters.

    Examples:
        >>> from torch.nn.init import xavier_uniform_
        >>> check_keywords("init_model", FILTERS, xavier_uniform_, {"gain": 2.0})
        >>> check_keywords("init_model", FILTERS, xavier_uniform_, {"module": None})
        Traceback (most recent call last):
        ...
        packedinit.errors.PackedInitTypeError: init_model(..., module=...): ... did you mean `modules=`? ...
    """
    if not kwargs:
        return
    for fn in _functions(init_fn):
        taken = _taken(fn)
        if taken is None:
            continue
        for given in kwargs:
            key = given
            if key in taken:
                continue
            name = fn_name(fn)
            others = [f for f in FILTERS if f not in own]
            close = difflib.get_close_matches(key, [*own, *taken, *others], n=1, cutoff=0.75)
            if close and close[0] in others:
                key = close[0]
                raise PackedInitTypeError(
                    f"{call}(module, ..., {given}=...): {call} has no filters and {name} takes no keyword "
                    f"{given!r}; did you mean packedinit.init_model's filter `{key}=`? Nothing was written; {name} "
                    f"was not called. Fix: packedinit.init_model(module, {name}, {key}=...)."
                )
            if close:
                whose = f"{call}'s own" if close[0] in own else f"{name}'s"
                raise PackedInitTypeError(
                    f"{call}(..., {key}=...): neither {call} nor {name} takes a keyword {key!r}; did you mean "
                    f"`{close[0]}=`? (It is {whose} keyword.) Nothing was written; {name} was not called."
                )
