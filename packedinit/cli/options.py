"""The command line's argument parser: its options, help text and the exit statuses it documents."""

from __future__ import annotations

import argparse
from typing import NoReturn

from packedinit.cli.parse import UsageError, parse_seed

__all__ = ["build_parser"]

EXIT_OK = 0
EXIT_PACKED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_CANNOT_TELL = 4
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``packedinit: error: ... (see 'packedinit audit --help')``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"packedinit: error: {' '.join(message.split())} (see '{self.prog} --help')\n")


def _seed_type(text: str) -> int:
    try:
        return parse_seed(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--seed ")) from None


_EXIT_CODES = (
    "exit codes: 0 ok; 1 --check found affected parameters; 2 bad command line or target (a factory that raised "
    "included); 3 packedinit refused the model; 4 --check cannot tell (no values to measure); 130 interrupted."
)


def build_parser() -> argparse.ArgumentParser:
    """The ``packedinit`` parser: ``--version``, the ``audit`` and ``fingerprint`` commands with their options."""
    parser = _Parser(
        prog="packedinit",
        description="Correct torch.nn.init for packed parameters (fused QKV, LSTM/GRU gates, GQA, MoE experts).",
        epilog=_EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    a = sub.add_parser(
        "audit",
        help="audit a model's packed parameters (default: a built-in demo model)",
        description="Audit every packed parameter of a model, block by block: measured std, what per-block and "
        "whole-tensor (packed) inits give, and a verdict. With no TARGET: a built-in demo model "
        "(TransformerEncoderLayer, LSTM, GRU), before and after packedinit.",
        epilog="TARGET is package.module:factory: it is imported and called like python -c would (never pass one "
        "you do not trust); ARGs are key=value (or positional) Python literals, never evaluated code. "
        "A factory returning a transformers config is built with transformers.AutoModel.from_config. "
        "Examples: 'torch.nn:MultiheadAttention embed_dim=512 num_heads=8', "
        "'transformers:GPT2Config n_layer=2 n_embd=64 n_head=4'. " + _EXIT_CODES,
    )
    a.add_argument("target", nargs="?", metavar="TARGET", help="package.module:factory (default: the demo model)")
    a.add_argument("args", nargs="*", metavar="ARG", help="factory arguments: key=value or positional literals")
    a.add_argument(
        "--init",
        metavar="FN",
        help="also show the effect of this torch.nn.init function run on each packed tensor and run per block "
        "(e.g. xavier_uniform_, \"kaiming_normal_(nonlinearity='relu')\"); the demo uses xavier_uniform_",
    )
    a.add_argument("--json", action="store_true", help="print JSON instead of tables (NaN/inf are written as null)")
    a.add_argument("--meta", action="store_true", help="build the model on the meta device: shapes and fans only")
    a.add_argument(
        "--seed",
        type=_seed_type,
        default=0,
        metavar="N",
        help="torch.manual_seed(N) before building and each init (default 0; 0 <= N < 2**64)",
    )
    a.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if parameters of the model as built are affected; 4 if it cannot tell (no values to measure)",
    )
    f = sub.add_parser(
        "fingerprint",
        help="fingerprint a model's init block by block (hash, std, min/max), or compare with a saved one",
        description="Fingerprint every logical block of a model: shape, fans, mean, std, min, max and a 64-bit hash "
        "of the block's values that storage, fusion and sharding do not change (packedinit.fingerprint).",
        epilog="TARGET and ARGs as for 'audit'. Exit codes: 0 ok; 1 --against found differing blocks; "
        "2 bad command line or target; 3 packedinit refused the model.",
    )
    f.add_argument("target", metavar="TARGET", help="package.module:factory")
    f.add_argument("args", nargs="*", metavar="ARG", help="factory arguments: key=value or positional literals")
    f.add_argument("--json", action="store_true", help="print the fingerprint as JSON (Fingerprint.from_json reads it)")
    f.add_argument("--meta", action="store_true", help="build the model on the meta device: shapes and fans only")
    f.add_argument(
        "--seed", type=_seed_type, default=0, metavar="N", help="torch.manual_seed(N) before building (default 0)"
    )
    f.add_argument("--against", metavar="FILE", help="compare with a fingerprint saved by --json; exit 1 if any differ")
    return parser


def _version() -> str:
    from packedinit import __version__

    return __version__
