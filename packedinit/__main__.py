"""``python -m packedinit`` and the ``packedinit`` console script (see :mod:`packedinit.cli.command`)."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit code.

    Exit codes: 0 ok; 1 ``--check`` found packed-init signatures; 2 bad command
    line or target; 3 packedinit refused the model; 130 interrupted.
    """
    from packedinit.cli.command import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
