"""Fuzzing the command line: arbitrary text never gives a traceback or an exit code other than 0, 1 or 2.

``main`` runs in process on argv lists that never name an importable target (so no arbitrary
module is imported); ``--init`` texts are also run end to end on a tiny ``MultiheadAttention``.
A failure must be one line on stderr, and never the last-resort "internal error": that
path exists for bugs, and the fuzzer must not find one.
"""

from __future__ import annotations

import io
import re

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from packedinit.cli.command import main
from packedinit.cli.options import EXIT_OK, EXIT_PACKED, EXIT_USAGE
from packedinit.cli.parse import SEED_MAX, Target, UsageError, parse_init, parse_seed, parse_target

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_TARGET_LIKE = re.compile(rf"{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*")

OPTIONS = ["audit", "--init", "--seed", "--json", "--meta", "--check", "--help", "-h", "--version", "--", "-", "--in"]
INIT_NAMES = ["xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "normal_"]
INIT_NAMES += ["uniform_", "trunc_normal_", "eye_", "zeros_", "sparse_", "xavier", "calculate_gain", "os.system"]
KEYS = ["gain", "std", "mean", "a", "b", "mode", "nonlinearity", "generator", "sparsity", "x"]

numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from(["'fan_in'", "'fan_out'", "'relu'", "'tanh'", "'leaky_relu'", "None", "True", "[1]", "'x'"]),
)


@st.composite
def init_texts(draw: st.DrawFn) -> str:
    """``name(arg, key=value, ...)`` with hostile values (inf, nan, huge, wrong types), or free text."""
    if draw(st.booleans()):
        return draw(st.text(max_size=40))
    name = draw(st.sampled_from(INIT_NAMES))
    args = [repr(v) if not isinstance(v, str) else v for v in draw(st.lists(numbers, max_size=2))]
    kwargs = draw(st.dictionaries(st.sampled_from(KEYS), numbers, max_size=3))
    parts = args + [f"{k}={v!r}" if not isinstance(v, str) else f"{k}={v}" for k, v in kwargs.items()]
    text = f"{name}({', '.join(parts)})" if parts or draw(st.booleans()) else name
    return text.replace("inf", "1e999")  # repr(inf) is not a literal; 1e999 is, and reads as inf


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def check_outcome(code: int, out: str, err: str) -> None:
    assert code in (EXIT_OK, EXIT_PACKED, EXIT_USAGE), (code, err)
    assert "Traceback" not in err
    assert "internal error" not in err, err  # the last-resort handler is for bugs: the fuzzer must not reach it
    if code == EXIT_USAGE:
        assert out == ""
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("packedinit: error: ")


@given(st.lists(st.one_of(st.sampled_from(OPTIONS), st.text(max_size=30)), max_size=8))
def test_arbitrary_argv_never_crashes(argv: list[str]) -> None:
    assume(not any(_TARGET_LIKE.fullmatch(a) for a in argv))  # nothing that could import a module
    check_outcome(*run_main(argv))


@given(st.lists(st.one_of(st.sampled_from(OPTIONS[1:]), st.text(max_size=20)), max_size=6))
def test_arbitrary_audit_options_never_crash(argv: list[str]) -> None:
    assume(not any(_TARGET_LIKE.fullmatch(a) for a in argv))
    check_outcome(*run_main(["audit", *argv]))


@given(init_texts(), st.integers(min_value=0, max_value=SEED_MAX))
def test_any_init_on_a_real_model_never_crashes(init: str, seed: int) -> None:
    argv = ["audit", "--init", init, "--seed", str(seed), "torch.nn:MultiheadAttention", "8", "2"]
    code, out, err = run_main(argv)
    check_outcome(code, out, err)
    if code == EXIT_OK:
        assert "(the 'chunked' column).\nanswer for the model as built" in out
        assert "affected: 1 packed parameter initialised whole (in_proj_weight); fix:" in out  # MHA's own default


@given(init_texts())
def test_parse_init_returns_a_checked_init_or_a_usage_error(text: str) -> None:
    try:
        fn, ref = parse_init(text)
    except UsageError as e:
        message = str(e)
    else:
        assert fn is getattr(torch.nn.init, ref.fn)
        std = ref.std((8, 8))
        assert std is None or 0 <= std < 1e15
        return
    assert "\n" not in message


@given(st.text(max_size=40), st.lists(st.text(max_size=40), max_size=5))
def test_parse_target_returns_a_target_or_a_usage_error(target: str, args: list[str]) -> None:
    try:
        t = parse_target(target, args)
    except UsageError:
        return
    assert isinstance(t, Target)
    assert f"{t.module}:{t.attr}" == target
    assert len(t.args) + len(t.kwargs) == len(args)


@given(st.one_of(st.text(max_size=30), st.integers(min_value=-(2**70), max_value=2**70).map(str)))
def test_parse_seed_accepts_exactly_what_torch_accepts(text: str) -> None:
    try:
        seed = parse_seed(text)
    except UsageError:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            return
        assert not 0 <= value <= SEED_MAX
        return
    torch.Generator().manual_seed(seed)  # torch takes it
    assert 0 <= seed <= SEED_MAX
