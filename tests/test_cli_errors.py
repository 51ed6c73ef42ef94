"""The command line never crashes: every bad input is one line on stderr and exit code 2.

Each case below was a traceback, a wrong exit code or a silent wrong answer before (issue 11).
Targets that need a hostile factory (NaN weights, ``sys.exit``) live in a module built on the fly.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

import packedinit
from packedinit.auditing.measure import audit
from packedinit.cli.command import affected, json_safe, main
from packedinit.cli.options import EXIT_INTERRUPTED, EXIT_OK, EXIT_PACKED, EXIT_USAGE
from packedinit.cli.parse import SEED_MAX, UsageError, build_target, parse_init, parse_target
from packedinit.cli.words import did_you_mean

ROOT = Path(__file__).resolve().parent.parent
DEEP = "[" * 60_000 + "]" * 60_000  # MemoryError / RecursionError in the parser


def run_main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int, out: str, err: str, pattern: str) -> str:
    assert code == EXIT_USAGE, err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("packedinit: error: ")
    assert "Traceback" not in line
    assert len(line) < 400, line  # a 120,000-character argument is shortened, not echoed
    assert re.search(pattern, line), line
    return line


MHA = ["torch.nn:MultiheadAttention", "8", "2"]


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--seed", str(10**30)], r"--seed: '1000000000000000000000000000000': out of range.*2\*\*64 - 1"),
        (["--seed", "-1"], r"out of range"),
        (["--seed", "1e3"], r"expected an integer"),
        (["--init", "uniform_(1.0, 0.0)", *MHA], r"torch refused it: RuntimeError: uniform_ expects"),
        (["--init", "normal_(std=-1.0)", *MHA], r"torch refused it: RuntimeError: normal expects std >= 0"),
        (["--init", "xavier_uniform_(gain=-1.0)", *MHA], r"'xavier_uniform_\(gain=-1.0\)': torch refused it"),
        (["--init", "orthogonal_(gain=-1.0)", *MHA], r"its std would be -0.35"),
        (["--init", "normal_(std=1e999)", *MHA], r"must be finite numbers"),
        (["--init", "xavier_uniform_(gain=1e999)", *MHA], r"must be finite numbers"),
        (["--init", "normal_(std=1e30)", *MHA], r"too large to measure"),
        (["--init", "uniform_(-1e20, 1e20)", *MHA], r"too large to measure"),
        (["--init", f"normal_(std={DEEP})", *MHA], r"\(120013 characters\): expected a name"),
        (["--init", DEEP, *MHA], r"\(120000 characters\): expected a name"),
        ([*MHA, f"bias={DEEP}"], r"argument bias: .*\(120000 characters\) is not a Python literal"),
        (["--init", "xavier", *MHA], r"no function 'xavier' \(did you mean 'xavier_normal_' or 'xavier_uniform_'\?\)"),
        (["--init", "kaiming_unifrom_", *MHA], r"did you mean 'kaiming_uniform_'"),
        (["--init", "xavier_uniform", *MHA], r"did you mean 'xavier_uniform_'"),
        (["torch.nn:Linaer", "4", "4"], r"'Linaer' not found \(did you mean 'Linear'"),
        (["torch.nnn:Linear"], r"No module named 'torch.nnn' \(did you mean 'torch.nn'\?\)$"),
        (["torhc.nn:Linear"], r"No module named 'torhc' \(did you mean 'torch'\?\)$"),
        (["transformers:GPT2Confg"], r"'GPT2Confg' not found \(did you mean 'GPT2Config'"),
        (["torch.nn:GRU", "4", "8", "--bogus"], r"unrecognized arguments: --bogus \(see 'packedinit --help'\)"),
        (["--json", "--seed"], r"argument --seed: expected one argument"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], pattern: str) -> None:
    assert_one_line_error(*run_main("audit", *args), pattern)


@pytest.mark.parametrize(
    "args",
    [
        ["transformers:GPT2Config", "n_layr=2", "n_embd=32", "n_head=4"],
        ["transformers:AutoConfig.for_model", "gpt2", "n_layr=2"],
    ],
)
def test_unknown_config_key_is_refused_with_a_suggestion(args: list[str]) -> None:
    # before: the key was kept as an unknown attribute and the default 12-layer GPT-2 was audited, exit 0
    assert_one_line_error(
        *run_main("audit", *args),
        r"GPT2Config has no key 'n_layr' \(did you mean 'n_layer'\?\); unknown keys would be ignored silently",
    )


def test_known_config_keys_aliases_and_properties_are_accepted() -> None:
    t = parse_target(
        "transformers:GPT2Config", ["num_hidden_layers=1", "hidden_size=32", "num_attention_heads=4", "num_labels=3"]
    )
    model = build_target(t)
    assert type(model).__name__ == "GPT2Model"
    assert model.config.n_layer == 1
    assert model.config.n_embd == 32
    assert len(model.h) == 1


def test_a_model_class_given_config_keywords_points_at_its_config() -> None:
    line = assert_one_line_error(
        *run_main("audit", "transformers:GPT2LMHeadModel", "n_layer=2", "n_embd=32"),
        r"is a model class built from a config",
    )
    assert "name its config instead: transformers:GPT2Config n_layer=2 n_embd=32" in line


@pytest.fixture
def hostile() -> Iterator[ModuleType]:
    """A module of factories, importable by name while the test runs."""
    mod = ModuleType("packedinit_cli_hostile_targets")

    def nan_mha() -> nn.Module:
        m = nn.MultiheadAttention(16, 2)
        with torch.no_grad():
            m.in_proj_weight[:16].fill_(float("nan"))
            m.in_proj_weight[16:32].fill_(float("inf"))
        return m

    def chatty_mha() -> nn.Module:
        print("hello from the factory")
        return nn.MultiheadAttention(16, 2)

    def exits(code: int) -> nn.Module:
        sys.exit(code)

    def interrupted() -> nn.Module:
        raise KeyboardInterrupt

    def per_block_mha() -> nn.Module:
        m = nn.MultiheadAttention(64, 4)
        packedinit.chunked(nn.init.xavier_uniform_)(m.in_proj_weight, 3)
        return m

    for f in (nan_mha, chatty_mha, exits, interrupted, per_block_mha):
        setattr(mod, f.__name__, f)
    sys.modules[mod.__name__] = mod
    try:
        yield mod
    finally:
        del sys.modules[mod.__name__]


@pytest.mark.parametrize("code", [0, 3])
def test_a_factory_calling_sys_exit_is_a_factory_that_raised(hostile: ModuleType, code: int) -> None:
    # before: the factory's own code became the process's exit code (0 looked like success)
    assert_one_line_error(
        *run_main("audit", f"{hostile.__name__}:exits", str(code)),
        rf"exits\({code}\) failed: a factory that raised SystemExit\({code}\)",
    )


def test_a_factory_interrupted_is_exit_130(hostile: ModuleType) -> None:
    code, out, err = run_main("audit", f"{hostile.__name__}:interrupted")
    assert code == EXIT_INTERRUPTED
    assert (out, err) == ("", "packedinit: error: interrupted\n")


@pytest.mark.parametrize("extra", [[], ["--init", "xavier_uniform_"]])
def test_json_is_valid_with_nan_and_inf_weights(hostile: ModuleType, extra: list[str]) -> None:
    code, out, err = run_main("audit", "--json", f"{hostile.__name__}:nan_mha", *extra)
    assert code == EXIT_OK, err
    assert "NaN" not in out
    assert "Infinity" not in out
    doc = json.loads(out)
    report = doc["report"] if not extra else doc["scenarios"][0]["report"]
    w = report["params"][0]
    assert w["name"] == "in_proj_weight"
    assert w["blocks"][0]["std"] is None  # the NaN block: unknown, written as null
    assert w["blocks"][1]["std"] is None  # the inf block
    assert w["blocks"][2]["std"] > 0


def test_json_is_not_corrupted_by_a_factory_that_prints(hostile: ModuleType) -> None:
    code, out, err = run_main("audit", "--json", f"{hostile.__name__}:chatty_mha")
    assert code == EXIT_OK, err
    assert json.loads(out)["report"]["model"] == "MultiheadAttention"
    assert err == "hello from the factory\n"


def test_json_safe_replaces_every_non_finite_float() -> None:
    doc = {"a": [1.5, float("nan"), {"b": (float("inf"), -float("inf"), 2)}], "c": "nan", "d": None, "e": True}
    safe = json_safe(doc)
    assert safe == {"a": [1.5, None, {"b": [None, None, 2]}], "c": "nan", "d": None, "e": True}
    assert json.loads(json.dumps(safe, allow_nan=False)) == safe


def test_check_fails_only_when_parameters_are_affected(hostile: ModuleType) -> None:
    assert affected(audit(nn.MultiheadAttention(64, 4)))  # xavier on the whole (3E, E) tensor
    m = nn.MultiheadAttention(64, 4)
    packedinit.chunked(nn.init.xavier_uniform_)(m.in_proj_weight, 3)
    assert not affected(audit(m))
    assert not affected(audit(nn.Linear(8, 8)))  # nothing packed at all
    assert run_main("audit", "--check", "torch.nn:MultiheadAttention", "64", "4")[0] == EXIT_PACKED
    assert run_main("audit", "--check", f"{hostile.__name__}:per_block_mha")[0] == EXIT_OK
    assert run_main("audit", "--check", "torch.nn:Linear", "8", "8")[0] == EXIT_OK
    # without --check the exit code never depends on the verdicts
    assert run_main("audit", "torch.nn:MultiheadAttention", "64", "4")[0] == EXIT_OK


def test_the_largest_seed_is_accepted() -> None:
    code, out, err = run_main("audit", "--seed", str(SEED_MAX), "torch.nn:GRU", "4", "8")
    assert code == EXIT_OK, err
    assert "weight_ih_l0" in out


def test_init_is_tried_without_touching_the_global_rng() -> None:
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    fn, ref = parse_init("normal_(std=0.5)")
    assert torch.equal(torch.rand(3), expected)
    assert fn is nn.init.normal_
    assert ref.std((4, 4)) == 0.5
    with pytest.raises(UsageError, match=r"must be Python literals"):
        parse_init("uniform_(a=float('nan'))")
    with pytest.raises(UsageError, match=r"must be finite numbers"):
        parse_init("trunc_normal_(std=1.0, a=-1e999)")


def test_did_you_mean() -> None:
    assert did_you_mean("n_layr", ["n_layer", "n_head"]) == " (did you mean 'n_layer'?)"
    assert did_you_mean("Linaer", ["Linear", "Bilinear", "_private"]) == " (did you mean 'Linear'?)"
    assert did_you_mean("_priv", ["_private"]) == " (did you mean '_private'?)"
    assert did_you_mean("priv", ["_private"]) == ""  # private names only when asked for
    assert did_you_mean("", ["a"]) == ""


def test_sys_exit_in_a_subprocess_does_not_become_the_exit_code() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(
        [sys.executable, "-m", "packedinit", "audit", "sys:exit", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert r.returncode == EXIT_USAGE
    assert r.stdout == ""
    assert r.stderr == "packedinit: error: sys:exit(0) failed: a factory that raised SystemExit(0)\n"
