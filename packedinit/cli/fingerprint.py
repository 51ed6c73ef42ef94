"""``python -m packedinit fingerprint TARGET [ARG ...] [--json] [--meta] [--seed N] [--against FILE]``.

Builds ``TARGET`` (as ``audit`` does: ``package.module:factory``, literal ``ARG`` values, seeded with
``--seed``) and prints :func:`packedinit.fingerprint` of it: a table, or with ``--json`` the JSON that
:meth:`packedinit.Fingerprint.from_json` reads back. ``--against FILE`` compares with a fingerprint saved
by ``--json`` (another machine, another world size): it prints what differs and exits 1 when any block does.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path
from typing import TextIO

import torch

from packedinit.auditing.fingerprint import Fingerprint, fingerprint
from packedinit.cli.options import EXIT_OK, EXIT_PACKED
from packedinit.cli.parse import UsageError, build_target, parse_target
from packedinit.errors import PackedInitError

__all__ = ["run_fingerprint"]


def run_fingerprint(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run the ``fingerprint`` command; 0, or 1 when ``--against`` found a differing block.

    Raises:
        UsageError: a bad TARGET or ARG, a factory that failed, an ``--against`` file that cannot be read.
    """
    against = None
    if ns.against is not None:
        try:
            against = Fingerprint.from_json(Path(ns.against).read_text())
        except OSError as e:
            raise UsageError(f"--against {ns.against}: cannot read it ({e.strerror})") from None
        except PackedInitError as e:
            raise UsageError(f"--against {ns.against}: {e}") from None
    target = parse_target(ns.target, ns.args)
    torch.manual_seed(ns.seed)
    with torch.device("meta") if ns.meta else nullcontext():
        model = build_target(target)
    fp = fingerprint(model)
    if ns.json:
        out.write(fp.to_json(indent=1) + "\n")
    else:
        out.write(f"target: {target}\n{fp}\n")
    if against is None:
        return EXIT_OK
    d = against.diff(fp)
    (out if not ns.json else err).write(f"against {ns.against}: {d.report()}\n")
    return EXIT_PACKED if d else EXIT_OK
