"""What the command line names: ``TARGET [ARG ...]``, ``--init FN`` and ``--seed N``, parsed and checked.

Everything here either returns a checked value or raises :class:`UsageError` (one line, exit
code 2). ``TARGET`` is imported and called like ``python -c`` would; its arguments, and the
arguments of ``--init``, are Python literals read with :func:`ast.literal_eval`, never ``eval``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from packedinit.auditing.measure import Reference
from packedinit.cli.configs import config_keys, is_hf_config, is_hf_config_class
from packedinit.cli.words import clip, did_you_mean, module_hint, shorten
from packedinit.errors import PackedInitError

__all__ = [
    "UsageError",
    "Target",
    "SEED_MAX",
    "parse_seed",
    "parse_target",
    "parse_init",
    "build_target",
]

#: The largest ``--seed`` torch accepts (``torch.manual_seed`` takes 0 to 2**64 - 1).
SEED_MAX = 2**64 - 1

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/]*\Z")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
#: The errors ``ast.parse`` / ``ast.literal_eval`` raise on hostile text (deep nesting included).
_LITERAL_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)
#: The biggest std the audit can measure: its float32 variance must stay finite with room to spare.
_MAX_STD = 1e15


class UsageError(Exception):
    """A command-line problem: reported as one line, exit code 2."""


def parse_seed(text: str) -> int:
    """``--seed``: an integer from 0 to ``2**64 - 1`` (what ``torch.manual_seed`` accepts).

    Raises:
        UsageError: not an integer, or out of range.

    Examples:
        >>> parse_seed("42")
        42
    """
    try:
        seed = int(text.strip(), 10)
    except ValueError:
        raise UsageError(f"--seed {shorten(text)}: expected an integer from 0 to 2**64 - 1") from None
    if not 0 <= seed <= SEED_MAX:
        raise UsageError(f"--seed {shorten(text)}: out of range; torch seeds run from 0 to 2**64 - 1")
    return seed


@dataclass(frozen=True)
class Target:
    """A parsed ``package.module:factory [ARG ...]``.

    Attributes:
        module: the module to import.
        attr: the dotted attribute path inside it (``"GPT2Config"``, ``"AutoConfig.for_model"``).
        args: positional arguments (Python literals).
        kwargs: keyword arguments (Python literals).
    """

    module: str
    attr: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs]
        return f"{self.module}:{self.attr}({', '.join(parts)})"


#: Bare words that read as a yes/no but are not ``true``/``false``: refused, never a (truthy) string.
_BOOLISH = frozenset({"yes", "no", "on", "off", "y", "n", "t", "f"})


def _literal(text: str, what: str) -> Any:
    word = text.strip().lower()
    if word in ("true", "false"):
        return word == "true"  # any case: bidirectional=false is False, never the truthy string 'false'
    if word in _BOOLISH:
        raise UsageError(f"{what}: {shorten(text)} is ambiguous; write true or false (any case)")
    try:
        return ast.literal_eval(text)
    except _LITERAL_ERRORS:
        if _WORD.match(text):
            return text  # a bare word is a string: nonlinearity=relu
        raise UsageError(f"{what}: {shorten(text)} is not a Python literal (quote strings: key='a b')") from None


def parse_target(target: str, args: Sequence[str] = ()) -> Target:
    """Parse ``package.module:factory`` and its ``key=value`` / positional arguments.

    Values are Python literals read with :func:`ast.literal_eval` (never ``eval``);
    a bare word that is not a literal (``relu``) is taken as a string.

    Args:
        target: ``package.module:factory`` (the factory may be dotted: ``Class.method``).
        args: ``key=value`` items and positional literals.

    Raises:
        UsageError: a malformed target or argument.

    Examples:
        >>> parse_target("torch.nn:MultiheadAttention", ["embed_dim=512", "num_heads=8"])
        Target(module='torch.nn', attr='MultiheadAttention', args=(), kwargs=(('embed_dim', 512), ('num_heads', 8)))
    """
    module, sep, attr = target.partition(":")
    if not sep or not _DOTTED.match(module) or not _DOTTED.match(attr):
        raise UsageError(
            f"TARGET {shorten(target)} must look like package.module:factory, e.g. 'torch.nn:MultiheadAttention'"
        )
    pos: list[Any] = []
    kw: dict[str, Any] = {}
    for item in args:
        key, eq, value = item.partition("=")
        if eq and key.isidentifier():
            if key in kw:
                raise UsageError(f"argument {key!r} given twice")
            kw[key] = _literal(value, f"argument {key}")
        else:
            if kw:
                raise UsageError(f"positional argument {shorten(item)} after keyword arguments")
            pos.append(_literal(item, "positional argument"))
    return Target(module, attr, tuple(pos), tuple(kw.items()))


def _init_functions() -> list[str]:
    """The public in-place ``torch.nn.init`` functions (``xavier_uniform_``, ...)."""
    return [
        n
        for n in dir(torch.nn.init)
        if n.endswith("_") and not n.startswith("_") and callable(getattr(torch.nn.init, n))
    ]


def _all_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, complex):
        return math.isfinite(value.real) and math.isfinite(value.imag)
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_all_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_all_finite(k) and _all_finite(v) for k, v in value.items())
    return True


def _trial(text: str, fn: Callable[..., Tensor], ref: Reference) -> None:
    """Run the init once on a small tensor (global RNG untouched) and check what the audit will need."""
    shape = (8, 8)
    trial = torch.empty(shape)
    try:
        with torch.random.fork_rng(devices=[]):
            fn(trial, **dict(ref.kwargs))
        std = ref.std(shape)
    except Exception as e:  # torch refuses the arguments: uniform_(1.0, 0.0), normal_(std=-1.0), ...
        raise UsageError(f"--init {shorten(text)}: torch refused it: {type(e).__name__}: {clip(e)}") from None
    if std is not None and not (math.isfinite(std) and std >= 0):
        raise UsageError(f"--init {shorten(text)}: its std would be {std:g}; use a gain/std/bounds giving std >= 0")
    measured = float(trial.double().std(correction=0))
    if not bool(torch.isfinite(trial).all()) or not math.isfinite(measured) or measured > _MAX_STD:
        raise UsageError(
            f"--init {shorten(text)}: its values are too large to measure in float32 (std must stay below 1e15)"
        )
    if std is not None and std > _MAX_STD:
        raise UsageError(f"--init {shorten(text)}: its std {std:g} is too large to measure (must stay below 1e15)")


def parse_init(text: str) -> tuple[Callable[..., Tensor], Reference]:
    """Parse ``--init``: a ``torch.nn.init`` function name, optionally called with literals.

    ``xavier_uniform_``, ``kaiming_normal_(nonlinearity='relu')``, ``uniform_(-0.1, 0.1)``.
    The init is tried once on a small tensor (the global RNG is left as it was), so arguments
    torch refuses (``uniform_(1.0, 0.0)``, ``normal_(std=-1.0)``), non-finite ones and values
    too large to measure are reported here, before any model is built.

    Returns:
        The function and the :class:`~packedinit.auditing.measure.Reference` for its std.

    Raises:
        UsageError: not a name or call of literals, not a supported function, or arguments
            torch refuses.

    Examples:
        >>> fn, ref = parse_init("kaiming_normal_(mode='fan_out')")
        >>> fn is torch.nn.init.kaiming_normal_, ref.name
        (True, "kaiming_normal_(mode='fan_out')")
    """
    shown = shorten(text)
    expected = f"--init {shown}: expected a name like xavier_uniform_ or a call like f(gain=2.0)"
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except _LITERAL_ERRORS:
        raise UsageError(expected) from None
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        try:
            args = [ast.literal_eval(a) for a in node.args]
            for k in node.keywords:
                if k.arg is None:
                    raise ValueError("**kwargs")
                kwargs[k.arg] = ast.literal_eval(k.value)
        except _LITERAL_ERRORS:
            raise UsageError(f"--init {shown}: arguments must be Python literals") from None
    elif isinstance(node, ast.Name):
        name = node.id
    else:
        raise UsageError(expected)
    known = _init_functions()
    if name not in known:
        hint = did_you_mean(name, known)
        raise UsageError(f"--init: torch.nn.init has no function {name!r}{hint}")
    fn = getattr(torch.nn.init, name)
    try:
        bound = inspect.signature(fn).bind(None, *args, **kwargs)
    except TypeError as e:
        raise UsageError(f"--init {shown}: {e}") from None
    kw = dict(list(bound.arguments.items())[1:])
    if not _all_finite(list(kw.values())):
        raise UsageError(f"--init {shown}: arguments must be finite numbers (no inf or nan)")
    try:
        ref = Reference.of(name, **kw)
    except PackedInitError as e:
        raise UsageError(f"--init: {' '.join(str(e).split())}") from None
    _trial(text, fn, ref)
    return fn, ref


def _check_config_keys(target: Target, factory: object, config: object) -> None:
    """Refuse keywords a transformers config would silently keep as unknown attributes (``n_layr=2``)."""
    owner = getattr(factory, "__self__", None)
    names_config = is_hf_config_class(factory) or (
        isinstance(owner, type) and owner.__module__.startswith("transformers") and "Config" in owner.__name__
    )
    if not names_config or not target.kwargs:
        return
    keys = config_keys(type(config))
    if keys is None:
        return
    for key, _ in target.kwargs:
        if key not in keys:
            raise UsageError(
                f"{target.module}:{target.attr}: {type(config).__name__} has no key {key!r}"
                f"{did_you_mean(key, keys)}; unknown keys would be ignored silently"
            )


def _resolve(target: Target) -> Any:
    try:
        obj: Any = importlib.import_module(target.module)
    except KeyboardInterrupt:
        raise
    except ModuleNotFoundError as e:
        hint = module_hint(e.name or target.module)
        raise UsageError(f"cannot import {target.module!r}: ModuleNotFoundError: {clip(e)}{hint}") from None
    except BaseException as e:  # any import failure (sys.exit at import included) is one line
        raise UsageError(f"cannot import {target.module!r}: {type(e).__name__}: {clip(e)}") from None
    for part in target.attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                names = dir(obj)
            except Exception:  # a hostile __dir__: no suggestion
                names = []
            raise UsageError(f"{target.module}:{target.attr}: {part!r} not found{did_you_mean(part, names)}") from None
        except Exception as e:  # lazy attributes (transformers) may fail on access
            raise UsageError(f"{target.module}:{target.attr}: {type(e).__name__}: {clip(e)}") from None
    return obj


def _refuse_model_class_with_keywords(target: Target, obj: object) -> None:
    config_class = getattr(obj, "config_class", None)
    if not (isinstance(obj, type) and issubclass(obj, nn.Module) and is_hf_config_class(config_class)):
        return
    if not (target.args or target.kwargs):
        return
    assert isinstance(config_class, type)
    module = sys.modules.get(target.module)
    where = target.module if getattr(module, config_class.__name__, None) is config_class else config_class.__module__
    kws = " ".join(f"{k}={v!r}" for k, v in target.kwargs)
    raise UsageError(
        f"{target.module}:{target.attr} is a model class built from a config, not from arguments; "
        f"name its config instead: {where}:{config_class.__name__} {kws}".rstrip()
        + " (the base model is built with AutoModel.from_config)"
    )


def build_target(target: Target) -> nn.Module:
    """Import and call a :class:`Target`; build a transformers model from a config.

    The rule: the factory is called with the arguments. If it returns an ``nn.Module``
    that is the model. If it returns a transformers config (``transformers:GPT2Config``,
    ``transformers:AutoConfig.for_model``), the model is
    ``transformers.AutoModel.from_config(config)`` (the base model, randomly initialised,
    nothing downloaded). A module instance named by the target is used as is.

    The target is trusted code: importing and calling it runs it, exactly as ``python -c``
    would (:func:`~packedinit.cli.command.main` sends whatever it prints to stderr, so ``--json`` output stays valid).

    Raises:
        UsageError: the module or attribute cannot be found (with did-you-mean suggestions),
            the call raised anything (``sys.exit`` included), a config key is unknown, a
            transformers model class was given arguments instead of its config, or the
            result is neither an ``nn.Module`` nor a transformers config.
    """
    obj = _resolve(target)
    if isinstance(obj, nn.Module) and not target.args and not target.kwargs:
        return obj
    if not callable(obj):
        raise UsageError(f"{target.module}:{target.attr} is a {type(obj).__name__}, not a factory or class")
    _refuse_model_class_with_keywords(target, obj)
    try:
        result = obj(*target.args, **dict(target.kwargs))
        if is_hf_config(result):
            _check_config_keys(target, obj, result)
            auto_model = importlib.import_module("transformers").AutoModel
            result = auto_model.from_config(result)
    except (UsageError, KeyboardInterrupt):
        raise
    except SystemExit as e:  # the factory called sys.exit: its code must not become ours
        raise UsageError(f"{target} failed: a factory that raised SystemExit({e.code!r})") from None
    except BaseException as e:  # the user's factory may raise anything: one line
        raise UsageError(f"{target} failed: {type(e).__name__}: {clip(e, 300)}") from None
    if not isinstance(result, nn.Module):
        raise UsageError(f"{target} returned a {type(result).__name__}, not an nn.Module or a transformers config")
    return result
