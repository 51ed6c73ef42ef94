"""The command line: ``python -m packedinit audit [TARGET [ARG ...]] [options]``.

``TARGET`` is ``package.module:factory``: it is imported and called, exactly like
``python -c "import package.module; package.module.factory(...)"`` would; never pass a target
you would not run. Its ``ARG`` values, and the arguments of ``--init``, are Python literals only
(read with :func:`ast.literal_eval`, never ``eval``). With no ``TARGET``: a built-in demo model.

Options of ``audit``:

* ``--init FN``: also run the ``torch.nn.init`` function ``FN`` (a name, or a call with literal
  arguments: ``"kaiming_normal_(nonlinearity='relu')"``) on each packed tensor, then per block,
  and show the three states side by side (the demo uses ``xavier_uniform_``);
* ``--json``: print JSON instead of tables (always valid JSON: NaN and inf are written as ``null``);
* ``--meta``: build the model on the meta device: shapes, layouts and fans only;
* ``--seed N``: ``torch.manual_seed(N)`` before building and before each init (default 0;
  0 <= N < 2**64);
* ``--check``: exit 1 when parameters of the model as built are affected by packing;
* ``-h`` / ``--help``: the help. ``packedinit --version`` prints the version.

``python -m packedinit fingerprint TARGET [ARG ...] [--json] [--meta] [--seed N] [--against FILE]``
prints :func:`packedinit.fingerprint` of the model (see :mod:`packedinit.cli.fingerprint`).

Exit codes:

* 0: the audit ran (with ``--check``: and no parameter is affected);
* 1: ``--check`` was given and some parameter is affected (see :func:`affected`);
* 2: bad command line: unknown option, malformed TARGET, ARG, ``--init`` or ``--seed``, a module
  or factory that cannot be imported, a factory that raised (``sys.exit`` included), an unknown
  config key, a result that is not a model; also any unexpected failure while auditing;
* 3: packedinit refused the model (a registered adapter or layout does not fit it);
* 4: ``--check`` was given, nothing measured is affected, but some packed parameter has no values
  to measure (a meta model, an int8 weight, all nan): the audit cannot tell (said on stderr);
* 130: interrupted (Ctrl-C).

Errors are one line on stderr (``packedinit: error: ...``), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, redirect_stdout
from typing import Any, TextIO

import torch
from torch import Tensor, nn

from packedinit.auditing.measure import AuditReport, Reference, audit
from packedinit.auditing.records import json_safe
from packedinit.cli.compare import render_comparison
from packedinit.cli.fingerprint import run_fingerprint
from packedinit.cli.options import (
    EXIT_CANNOT_TELL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PACKED,
    EXIT_REFUSED,
    EXIT_USAGE,
    build_parser,
)
from packedinit.cli.parse import (
    Target,
    UsageError,
    build_target,
    parse_init,
    parse_target,
)
from packedinit.cli.words import shorten
from packedinit.errors import PackedInitError
from packedinit.layout import Layout

__all__ = [
    "main",
    "Target",
    "UsageError",
    "parse_target",
    "parse_init",
    "build_target",
    "demo_model",
    "affected",
    "json_safe",
]


def affected(report: AuditReport) -> bool:
    """Whether ``--check`` fails (exit 1): some parameter of the model as built is affected by packing.

    That is :attr:`AuditReport.affected`: a described parameter whose verdict is ``packed`` or
    ``mixed``, or an undescribed one that looks packed and whose values show the packed
    init under the guessed layout. ``undecided``, ``unknown`` and ``fan-independent``
    verdicts never fail the check.

    Examples:
        >>> affected(audit(torch.nn.MultiheadAttention(64, 4)))  # xavier on the packed (3E, E) tensor
        True
        >>> affected(audit(torch.nn.Linear(8, 8)))  # nothing packed
        False
    """
    return bool(report.affected)


def _write_json(out: TextIO, doc: Any) -> None:
    out.write(json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n")


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


def _packed_items(model: nn.Module, layouts: dict[str, Layout]) -> Iterator[tuple[str, Tensor, Layout]]:
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[int] = set()
    for name, layout in layouts.items():
        p = params[name]
        if id(p) not in seen and p.dim() >= 2:
            seen.add(id(p))
            yield name, p, layout


def _error(stream: TextIO, msg: str) -> None:
    stream.write(f"packedinit: error: {' '.join(msg.split())}\n")
    stream.flush()


def _layouts(model: nn.Module) -> dict[str, Layout]:
    from packedinit.model.claims import layouts

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
    from packedinit.api import chunked_init

    items = list(_packed_items(model, layouts))
    kw = dict(ref.kwargs)
    with torch.no_grad():
        for k, (name, p, layout) in enumerate(items):
            progress.say(f"packedinit: {stage} [{k}/{len(items)}] {name}")
            if per_block:
                chunked_init(p, layout, None, fn, **kw)
            else:
                fn(p, **kw)


def _build(ns: argparse.Namespace, target: Target | None, target_text: str, progress: Progress) -> nn.Module:
    torch.manual_seed(ns.seed)
    progress.say(f"packedinit: building {target_text}")
    try:
        with torch.device("meta") if ns.meta else nullcontext():
            return demo_model() if target is None else build_target(target)
    finally:
        progress.clear()


def _run_audit(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    progress = Progress(err)
    init: tuple[Callable[..., Tensor], Reference] | None = parse_init(ns.init) if ns.init is not None else None
    target: Target | None = None
    if ns.target is None:
        if ns.args:
            raise UsageError(f"arguments {shorten(' '.join(ns.args))} need a TARGET")
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
    model = _build(ns, target, target_text, progress)
    try:
        layouts = _layouts(model)
        # the verdict: packedinit.audit(model) itself (looks-packed guesses included); --init never changes it
        report = audit(model, progress=progress.step("auditing"))
        if init is None:
            progress.clear()
            if ns.json:
                _write_json(out, {"target": target_text, "report": report.to_dict()})
            else:
                out.write(f"target: {target_text}\n{report}\n")
            return _exit_code(ns, report, err)
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
    finally:
        progress.clear()
    if ns.json:
        doc = {
            "target": target_text,
            "init": {"fn": ref.fn, "kwargs": dict(ref.kwargs), "describe": ref.describe()},
            "report": report.to_dict(),
            "scenarios": [{"name": n, "report": r.to_dict()} for n, r in reports],
        }
        _write_json(out, doc)
    else:
        title = f"packedinit audit (seed {ns.seed})\n{target_text}"
        out.write(render_comparison(reports, ref, title) + "\n")
        if ns.target is None:
            out.write(
                "note: LSTM/GRU's own default, uniform(-1/sqrt(hidden), 1/sqrt(hidden)), reads no fans: packing does\n"
                "      not change it (fan-independent);\n"
                "      MultiheadAttention's default is xavier_uniform_ on the packed (3E, E) tensor:\n"
                "      1/sqrt(2) too small per block (pytorch/pytorch#166378).\n"
            )
        kw = "".join(f", {k}={v!r}" for k, v in ref.kwargs)
        out.write(
            f"to init with {ref.fn} yourself: packedinit.chunked(torch.nn.init.{ref.fn})(model{kw})\n"
            "  runs it per logical block (the 'chunked' column).\n"
        )
        answer = textwrap.fill(report.answer(), width=110, subsequent_indent="  ", break_on_hyphens=False)
        out.write(f"answer for the model as built (its own default init):\n{answer}\n")
        if report.fix() is not None:
            out.write(
                "that fix is the narrowest call: it re-initialises only the parameters it names. For the broader\n"
                "  calls and what each changes, see 'Which call do I use' in the README.\n"
            )
    return _exit_code(ns, report, err)


def _exit_code(ns: argparse.Namespace, report: AuditReport, err: TextIO) -> int:
    """0, or with ``--check``: 1 affected, 4 cannot tell (said on stderr: never a silent pass)."""
    if not ns.check:
        return EXIT_OK
    if affected(report):
        return EXIT_PACKED
    if report.cannot_tell:
        _error(err, f"--check cannot tell: {report.answer()}")
        return EXIT_CANNOT_TELL
    return EXIT_OK


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the command line; return the exit code (see the module docstring).

    ``python -m packedinit audit [TARGET [ARG ...]] [--init FN] [--json] [--meta] [--seed N] [--check]``;
    ``packedinit --version``; ``-h`` / ``--help`` on either.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        stdout: where results go (default ``sys.stdout``).
        stderr: where errors and progress go (default ``sys.stderr``).

    Returns:
        0 ok; 1 ``--check`` found affected parameters; 2 bad command line or target (a factory
        that raised included); 3 packedinit refused the model; 4 ``--check`` cannot tell (no values
        to measure); 130 interrupted.

    Examples:
        >>> import io
        >>> err = io.StringIO()
        >>> main(["audit", "--seed", "10**30"], stderr=err)
        2
        >>> print(err.getvalue().strip())
        packedinit: error: argument --seed: '10**30': expected an integer from 0 to 2**64 - 1 (see ...)
    """
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    parser = build_parser()
    try:
        with _redirect(out, err):
            ns = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:  # argparse: --help / --version (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        with redirect_stdout(err):  # whatever else prints (a factory, a library) never lands in our output
            return (run_fingerprint if ns.command == "fingerprint" else _run_audit)(ns, out, err)
    except UsageError as e:
        _error(err, str(e))
        return EXIT_USAGE
    except PackedInitError as e:
        _error(err, str(e))
        return EXIT_REFUSED
    except KeyboardInterrupt:
        _error(err, "interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `packedinit audit | head`
        return EXIT_OK
    except Exception as e:  # a bug or a value torch cannot take: one line, not a traceback
        _error(err, f"internal error: {type(e).__name__}: {shorten(str(e), 300)} (please report it)")
        return EXIT_USAGE


@contextmanager
def _redirect(out: TextIO, err: TextIO) -> Iterator[None]:
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        sys.stdout, sys.stderr = old
