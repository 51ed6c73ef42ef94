"""The command line: ``python -m packedinit audit [TARGET [ARG ...]] [--init FN] [--json]``.

Exit codes:

* 0: the audit ran (with ``--check``: and no parameter shows the packed-init signature);
* 1: ``--check`` was given and some parameter shows the packed-init signature;
* 2: bad command line: unknown option, malformed TARGET or argument, a module or
  factory that cannot be imported, a factory that raised, a bad ``--init``;
* 3: packedinit refused the model (a registered adapter or layout does not fit it);
* 130: interrupted (Ctrl-C).

Errors are one line on stderr (``packedinit: error: ...``), never a traceback.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from torch import Tensor, nn

from .audit import AuditReport, Reference, audit, compact
from .errors import PackedInitError
from .layout import Layout, fmt_shape

__all__ = ["main", "Target", "parse_target", "parse_init", "build_target", "demo_model"]

EXIT_OK = 0
EXIT_PACKED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_INTERRUPTED = 130

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/]*\Z")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


class UsageError(Exception):
    """A command-line problem: reported as one line, exit code 2."""


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


def _literal(text: str, what: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        if _WORD.match(text):
            return text  # a bare word is a string: nonlinearity=relu
        raise UsageError(f"{what}: {text!r} is not a Python literal (quote strings: key='a b')") from None


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
        raise UsageError(f"TARGET {target!r} must look like package.module:factory, e.g. 'torch.nn:MultiheadAttention'")
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
                raise UsageError(f"positional argument {item!r} after keyword arguments")
            pos.append(_literal(item, "positional argument"))
    return Target(module, attr, tuple(pos), tuple(kw.items()))


def parse_init(text: str) -> tuple[Callable[..., Tensor], Reference]:
    """Parse ``--init``: a ``torch.nn.init`` function name, optionally called with literals.

    ``xavier_uniform_``, ``kaiming_normal_(nonlinearity='relu')``, ``uniform_(-0.1, 0.1)``.

    Returns:
        The function and the :class:`~packedinit.audit.Reference` for its std.

    Raises:
        UsageError: not a name or call of literals, or not a supported function.

    Examples:
        >>> fn, ref = parse_init("kaiming_normal_(mode='fan_out')")
        >>> fn is torch.nn.init.kaiming_normal_, ref.name
        (True, "kaiming_normal_(mode='fan_out')")
    """
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise UsageError(f"--init {text!r}: expected a name like xavier_uniform_ or a call like f(gain=2.0)") from None
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
        except ValueError:
            raise UsageError(f"--init {text!r}: arguments must be Python literals") from None
    elif isinstance(node, ast.Name):
        name = node.id
    else:
        raise UsageError(f"--init {text!r}: expected a name like xavier_uniform_ or a call like f(gain=2.0)")
    name = name.removeprefix("torch.nn.init.")
    fn = getattr(torch.nn.init, name, None)
    if fn is None or name.startswith("_") or not callable(fn):
        raise UsageError(f"--init: torch.nn.init has no function {name!r}")
    try:
        bound = inspect.signature(fn).bind(None, *args, **kwargs)
    except TypeError as e:
        raise UsageError(f"--init {text!r}: {e}") from None
    kw = {k: v for k, v in list(bound.arguments.items())[1:]}
    try:
        ref = Reference.of(name, **kw)
    except PackedInitError as e:
        raise UsageError(f"--init: {e}") from None
    return fn, ref


def _is_hf_config(obj: object) -> bool:
    return any(
        c.__name__ in ("PretrainedConfig", "PreTrainedConfig") and c.__module__.startswith("transformers")
        for c in type(obj).__mro__
    )


def build_target(target: Target) -> nn.Module:
    """Import and call a :class:`Target`; build a transformers model from a config.

    The rule: the factory is called with the arguments. If it returns an ``nn.Module``
    that is the model. If it returns a transformers config (``transformers:GPT2Config``,
    ``transformers:AutoConfig.for_model``), the model is
    ``transformers.AutoModel.from_config(config)`` (the base model, randomly initialised,
    nothing downloaded). A module instance named by the target is used as is.

    Raises:
        UsageError: the module or attribute cannot be found, the call raised, or the
            result is neither an ``nn.Module`` nor a transformers config.
    """
    try:
        obj: Any = importlib.import_module(target.module)
    except Exception as e:  # any import failure is reported as one line
        raise UsageError(f"cannot import {target.module!r}: {type(e).__name__}: {e}") from None
    for part in target.attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{target.module}:{target.attr}: {part!r} not found") from None
        except Exception as e:  # lazy attributes (transformers) may fail on access
            raise UsageError(f"{target.module}:{target.attr}: {type(e).__name__}: {e}") from None
    if isinstance(obj, nn.Module) and not target.args and not target.kwargs:
        return obj
    if not callable(obj):
        raise UsageError(f"{target.module}:{target.attr} is a {type(obj).__name__}, not a factory or class")
    try:
        result = obj(*target.args, **dict(target.kwargs))
        if _is_hf_config(result):
            auto_model = importlib.import_module("transformers").AutoModel
            result = auto_model.from_config(result)
    except Exception as e:  # the user's factory may raise anything: one line
        msg = " ".join(str(e).split())
        raise UsageError(f"{target} failed: {type(e).__name__}: {msg[:300]}") from None
    if not isinstance(result, nn.Module):
        raise UsageError(f"{target} returned a {type(result).__name__}, not an nn.Module or a transformers config")
    return result


#: The demo model's description, shown in the output.
DEMO = "encoder = TransformerEncoderLayer(d_model=128, nhead=4), lstm = LSTM(64, 128), gru = GRU(64, 128)"


def demo_model() -> nn.Module:
    """The built-in demo: a torch ``TransformerEncoderLayer``, an ``LSTM`` and a ``GRU`` with torch's defaults."""
    return nn.ModuleDict(
        {
            "encoder": nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256),
            "lstm": nn.LSTM(64, 128),
            "gru": nn.GRU(64, 128),
        }
    )


class Progress:
    """A one-line progress indicator on a terminal's stderr; silent when stderr is not a terminal."""

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._dirty = False

    def say(self, text: str) -> None:
        """Show ``text`` in place of the previous message."""
        if not self.enabled:
            return
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self.stream.write("\r" + text[:width].ljust(width))
        self.stream.flush()
        self._dirty = True

    def step(self, stage: str) -> Callable[[int, int, str], None]:
        """A ``progress(done, total, name)`` callback for :func:`~packedinit.audit`."""

        def cb(done: int, total: int, name: str) -> None:
            if total >= 1:
                self.say(f"packedinit: {stage} [{done}/{total}] {name}")

        return cb

    def clear(self) -> None:
        """Erase the line."""
        if self.enabled and self._dirty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r" + " " * width + "\r")
            self.stream.flush()
            self._dirty = False


def _fmt_std(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4f}" if x >= 1e-3 or x == 0 else f"{x:.1e}"


_SHORT = {"per-block": "ok", "packed": "PACKED", "ambiguous": "?", "unknown": "other", "constant": "const"}


def _packed_items(model: nn.Module, layouts: dict[str, Layout]) -> Iterator[tuple[str, Tensor, Layout]]:
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[int] = set()
    for name, layout in layouts.items():
        p = params[name]
        if id(p) not in seen and p.dim() >= 2:
            seen.add(id(p))
            yield name, p, layout


def render_comparison(reports: Sequence[tuple[str, AuditReport]], ref: Reference, title: str) -> str:
    """The before/after table: one column of measured stds per scenario, 2-D blocks only."""
    first = reports[0][1]
    lines = [title, f"init: {ref.describe()}; 'per-block' = the std it gives each logical block on its own"]
    lines.append("cells: measured std, ratio to per-block, verdict (ok = per-block; PACKED = the init ran on the")
    lines.append("       whole packed tensor; other = neither)")
    lines.append("")
    rows: list[tuple[str, ...]] = []
    for pi, p in enumerate(first.params):
        if p.blocks and p.blocks[0].fan_in is None:
            continue
        rows.append((f"{p.name}  {fmt_shape(p.shape)}  [{compact(p.layout)}]",))
        for bi, b in enumerate(p.blocks):
            expected = b.expected_std(ref.name).per_block
            cells = [f"  {b.label}", fmt_shape(b.shape), str(b.fan_in), str(b.fan_out), _fmt_std(expected)]
            for _, rep in reports:
                rb = rep.params[pi].blocks[bi]
                if rb.std is None or not expected:
                    cells.append(_fmt_std(rb.std))
                else:
                    cells.append(f"{_fmt_std(rb.std)} {rb.std / expected:4.2f}x {_SHORT.get(rb.verdict, rb.verdict)}")
            rows.append(tuple(cells))
    head = ("  block", "shape", "fan_in", "fan_out", "per-block", *(name for name, _ in reports))
    ncols = len(head)
    widths = [max([len(head[i])] + [len(r[i]) for r in rows if len(r) == ncols]) for i in range(ncols)]
    left = {0, 1}
    lines.append(
        "  ".join(h.ljust(w) if i in left else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths, strict=False)))
    )
    for r in rows:
        if len(r) == 1:
            lines.append(r[0])
        else:
            lines.append(
                "  ".join(
                    c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))
                )
            )
    lines.append("")
    for name, rep in reports:
        ratios: list[float] = []
        counts: dict[str, int] = {}
        for p in rep.params:
            for b in p.blocks:
                e = b.expected_std(ref.name).per_block
                if b.fan_in is None or b.std is None or not e:
                    continue
                ratios.append(b.std / e)
                counts[_SHORT.get(b.verdict, b.verdict)] = counts.get(_SHORT.get(b.verdict, b.verdict), 0) + 1
        if ratios:
            tally = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
            lines.append(f"{name}: {tally}; std / per-block std from {min(ratios):.2f}x to {max(ratios):.2f}x")
    if not rows:
        lines.append("no 2-D packed parameters: nothing to compare.")
    return "\n".join(lines)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packedinit",
        description="Correct torch.nn.init for packed parameters (fused QKV, LSTM/GRU gates, GQA, MoE experts).",
        epilog="exit codes: 0 ok; 1 --check found packed-init signatures; 2 bad command line or target; "
        "3 packedinit refused the model; 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    a = sub.add_parser(
        "audit",
        help="audit a model's packed parameters (default: a built-in demo model)",
        description="Audit every packed parameter of a model, block by block: measured std, what per-block and "
        "whole-tensor (packed) inits give, and a verdict. With no TARGET: a built-in demo model "
        "(TransformerEncoderLayer, LSTM, GRU), before and after packedinit.",
        epilog="TARGET is package.module:factory; ARGs are key=value (or positional) Python literals. "
        "A factory returning a transformers config is built with transformers.AutoModel.from_config. "
        "Examples: 'torch.nn:MultiheadAttention embed_dim=512 num_heads=8', "
        "'transformers:GPT2Config n_layer=2 n_embd=64 n_head=4'. "
        "Exit codes: 0 ok; 1 --check found packed-init signatures; 2 bad command line or target; "
        "3 packedinit refused the model; 130 interrupted.",
    )
    a.add_argument("target", nargs="?", metavar="TARGET", help="package.module:factory (default: the demo model)")
    a.add_argument("args", nargs="*", metavar="ARG", help="factory arguments: key=value or positional literals")
    a.add_argument(
        "--init",
        metavar="FN",
        help="also show the effect of this torch.nn.init function run on each packed tensor and run per block "
        "(e.g. xavier_uniform_, \"kaiming_normal_(nonlinearity='relu')\"); the demo uses xavier_uniform_",
    )
    a.add_argument("--json", action="store_true", help="print JSON instead of tables")
    a.add_argument("--meta", action="store_true", help="build the model on the meta device: shapes and fans only")
    a.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building and each init (default 0)")
    a.add_argument("--check", action="store_true", help="exit 1 if the model as built shows the packed-init signature")
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def _error(stream: TextIO, msg: str) -> None:
    stream.write(f"packedinit: error: {msg}\n")
    stream.flush()


def _layouts(model: nn.Module) -> dict[str, Layout]:
    from .registry import layouts

    return dict(layouts(model))


def _apply(
    model: nn.Module,
    layouts: dict[str, Layout],
    fn: Callable[..., Tensor],
    ref: Reference,
    per_block: bool,
    progress: Progress,
    stage: str,
) -> None:
    from .api import chunked_init

    items = list(_packed_items(model, layouts))
    kw = dict(ref.kwargs)
    with torch.no_grad():
        for k, (name, p, layout) in enumerate(items):
            progress.say(f"packedinit: {stage} [{k}/{len(items)}] {name}")
            if per_block:
                chunked_init(p, layout, None, fn, **kw)
            else:
                fn(p, **kw)


def _run_audit(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    progress = Progress(err)
    init: tuple[Callable[..., Tensor], Reference] | None = parse_init(ns.init) if ns.init else None
    if ns.target is None:
        if ns.args:
            raise UsageError(f"arguments {ns.args} need a TARGET")
        if init is None:
            init = parse_init("xavier_uniform_")
        target_text = "demo model: " + DEMO
        as_built = "torch default"
    else:
        target = parse_target(ns.target, ns.args)
        target_text = str(target)
        as_built = "as built"
    if init is not None and ns.meta:
        raise UsageError("--init needs real tensors to measure; drop --meta")
    torch.manual_seed(ns.seed)
    progress.say(f"packedinit: building {target_text}")
    try:
        with torch.device("meta") if ns.meta else nullcontext():
            model = demo_model() if ns.target is None else build_target(target)
    finally:
        progress.clear()
    try:
        layouts = _layouts(model)
        if init is None:
            report = audit(model, layouts=layouts, progress=progress.step("auditing"))
            progress.clear()
            if ns.json:
                out.write(json.dumps({"target": target_text, "report": report.to_dict()}, indent=2, allow_nan=False))
                out.write("\n")
            else:
                out.write(f"target: {target_text}\n{report}\n")
            return EXIT_PACKED if ns.check and report.packed else EXIT_OK
        fn, ref = init
        refs = (ref,)
        reports: list[tuple[str, AuditReport]] = []
        reports.append((as_built, audit(model, layouts=layouts, references=refs, progress=progress.step("auditing"))))
        torch.manual_seed(ns.seed)
        _apply(model, layouts, fn, ref, False, progress, f"{ref.fn} on whole tensors")
        whole = f"{ref.fn}(p)"
        reports.append((whole, audit(model, layouts=layouts, references=refs, progress=progress.step("auditing"))))
        torch.manual_seed(ns.seed)
        _apply(model, layouts, fn, ref, True, progress, f"{ref.fn} per block")
        reports.append(("chunked", audit(model, layouts=layouts, references=refs, progress=progress.step("auditing"))))
        progress.clear()
    except PackedInitError as e:
        progress.clear()
        _error(err, " ".join(str(e).split()))
        return EXIT_REFUSED
    if ns.json:
        doc = {
            "target": target_text,
            "init": {"fn": ref.fn, "kwargs": dict(ref.kwargs), "describe": ref.describe()},
            "scenarios": [{"name": n, "report": r.to_dict()} for n, r in reports],
        }
        out.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    else:
        title = f"packedinit audit (seed {ns.seed})\n{target_text}"
        out.write(render_comparison(reports, ref, title) + "\n")
        if ns.target is None:
            out.write(
                "note: LSTM/GRU's own default, uniform(-1/sqrt(hidden), 1/sqrt(hidden)), is not fan-based ('other');\n"
                "      MultiheadAttention's default is xavier_uniform_ on the packed (3E, E) tensor:\n"
                "      1/sqrt(2) too small per block (pytorch/pytorch#166378).\n"
            )
        kw = "".join(f", {k}={v!r}" for k, v in ref.kwargs)
        out.write(
            f"fix: packedinit.chunked(torch.nn.init.{ref.fn})(model{kw}) runs it per logical block "
            "(the 'chunked' column).\n"
        )
    return EXIT_PACKED if ns.check and reports[0][1].packed else EXIT_OK


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the command line; return the exit code (see the module docstring).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        stdout: where results go (default ``sys.stdout``).
        stderr: where errors and progress go (default ``sys.stderr``).
    """
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    parser = _build_parser()
    try:
        with _redirect(out, err):
            ns = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:  # argparse: --help / --version (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return _run_audit(ns, out, err)
    except UsageError as e:
        _error(err, str(e))
        return EXIT_USAGE
    except PackedInitError as e:
        _error(err, " ".join(str(e).split()))
        return EXIT_REFUSED
    except KeyboardInterrupt:
        _error(err, "interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `packedinit audit | head`
        return EXIT_OK


@contextmanager
def _redirect(out: TextIO, err: TextIO) -> Iterator[None]:
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        sys.stdout, sys.stderr = old
