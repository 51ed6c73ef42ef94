"""The command line: end to end in a subprocess, plus its parsers and exit codes in process."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from packedinit.__main__ import main as entry_main
from packedinit.cli.command import (
    EXIT_OK,
    EXIT_PACKED,
    EXIT_REFUSED,
    EXIT_USAGE,
    Progress,
    Target,
    UsageError,
    build_target,
    main,
    parse_init,
    parse_target,
)

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "packedinit", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def run_main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


# -- end to end, in a subprocess -------------------------------------------------------------------


def test_default_demo_before_and_after() -> None:
    r = run_cli("audit")
    assert r.returncode == EXIT_OK, r.stderr
    assert r.stderr == ""  # no progress output when stderr is not a terminal
    out = r.stdout
    assert "demo model: encoder = TransformerEncoderLayer" in out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 120
    i = lines.index(next(line for line in lines if line.startswith("encoder.self_attn.in_proj_weight")))
    q_row = lines[i + 1].split()
    assert q_row[0] == "q"
    assert "PACKED" in lines[i + 1]
    assert lines[i + 1].rstrip().endswith("ok")
    for name in ("lstm.weight_ih_l0", "lstm.weight_hh_l0", "gru.weight_ih_l0", "gru.weight_hh_l0"):
        assert any(line.startswith(name) for line in lines), name
    assert "torch default: 14 fan-independent, 3 PACKED" in out
    assert "affected: 1 packed parameter initialised whole (encoder.self_attn.in_proj_weight)" in out
    assert "xavier_uniform_(p): 17 PACKED" in out
    assert "chunked: 17 ok" in out


def test_torch_target_and_check_exit_code() -> None:
    r = run_cli("audit", "torch.nn:MultiheadAttention", "embed_dim=64", "num_heads=4")
    assert r.returncode == EXIT_OK, r.stderr
    assert "target: torch.nn:MultiheadAttention(embed_dim=64, num_heads=4)" in r.stdout
    assert "in_proj_weight  (192, 64)" in r.stdout
    assert "packed: xavier" in r.stdout
    r = run_cli("audit", "--check", "torch.nn:MultiheadAttention", "embed_dim=64", "num_heads=4")
    assert r.returncode == EXIT_PACKED


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_such_pkg.mod:f"], "cannot import 'no_such_pkg.mod': ModuleNotFoundError"),
        (["torch.nn:NoSuchLayer"], "'NoSuchLayer' not found"),
        (["torch.nn.MultiheadAttention"], "must look like package.module:factory"),
        (["torch.nn:MultiheadAttention", "embed_dim=10", "num_heads=3"], "failed: AssertionError"),
        (["torch.nn:MultiheadAttention", "embed_dim=(1,"], "not a Python literal"),
        (["--init", "eye_"], "no closed-form std"),
    ],
)
def test_bad_target_is_one_line(args: list[str], message: str) -> None:
    code, out, err = run_main("audit", *args)
    assert code == EXIT_USAGE
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("packedinit: error: ")
    assert message in lines[0]


def test_bad_target_in_a_subprocess_is_not_a_traceback() -> None:
    r = run_cli("audit", "torch.nn:MultiheadAttention", "embed_dim=10", "num_heads=3")
    assert r.returncode == EXIT_USAGE
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "packedinit: error: torch.nn:MultiheadAttention(embed_dim=10, num_heads=3) failed: "
        "AssertionError: embed_dim must be divisible by num_heads"
    ]


def test_json_parses_back() -> None:
    r = run_cli("audit", "--json", "torch.nn:LSTM", "input_size=16", "hidden_size=32")
    assert r.returncode == EXIT_OK, r.stderr
    doc = json.loads(r.stdout)
    assert doc["target"] == "torch.nn:LSTM(input_size=16, hidden_size=32)"
    rep = doc["report"]
    names = [p["name"] for p in rep["params"]]
    assert names == ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"]
    ih = rep["params"][0]
    assert ih["layout"]["names"] == ["i", "f", "g", "o"]
    assert [b["shape"] for b in ih["blocks"]] == [[32, 16]] * 4
    assert ih["blocks"][0]["std"] > 0
    r = run_cli("audit", "--json")  # the demo: three scenarios
    doc = json.loads(r.stdout)
    assert [s["name"] for s in doc["scenarios"]] == ["torch default", "xavier_uniform_(p)", "chunked"]
    assert doc["scenarios"][2]["report"]["counts"]["per-block"] == 5


def test_console_script_entry_point_exists() -> None:
    r = run_cli("--version")
    assert r.returncode == 0
    assert r.stdout.startswith("packedinit ")
    r = run_cli()
    assert r.returncode == EXIT_USAGE
    assert "COMMAND" in r.stderr


# -- in process: parsers, target rules, exit codes -----------------------------------------------


def test_parse_target() -> None:
    t = parse_target("torch.nn:MultiheadAttention", ["embed_dim=512", "num_heads=8", "bias=False"])
    assert t == Target("torch.nn", "MultiheadAttention", (), (("embed_dim", 512), ("num_heads", 8), ("bias", False)))
    t = parse_target("transformers:AutoConfig.for_model", ["gpt2", "n_layer=2", "act=relu", "x=[1, 2]", "s='a b'"])
    assert t.attr == "AutoConfig.for_model"
    assert t.args == ("gpt2",)
    assert dict(t.kwargs) == {"n_layer": 2, "act": "relu", "x": [1, 2], "s": "a b"}
    with pytest.raises(UsageError, match="given twice"):
        parse_target("a:b", ["x=1", "x=2"])
    with pytest.raises(UsageError, match="after keyword"):
        parse_target("a:b", ["x=1", "2"])
    with pytest.raises(UsageError, match="not a Python literal"):
        parse_target("a:b", ["x=__import__('os').system('true')"])
    with pytest.raises(UsageError, match=r"package\.module:factory"):
        parse_target("a:b c", [])


def test_parse_init() -> None:
    fn, ref = parse_init("xavier_uniform_")
    assert fn is torch.nn.init.xavier_uniform_
    assert ref.kwargs == ()
    fn, ref = parse_init("uniform_(-0.1, 0.1)")
    assert dict(ref.kwargs) == {"a": -0.1, "b": 0.1}
    fn, ref = parse_init("kaiming_normal_(nonlinearity='relu')")
    assert fn is torch.nn.init.kaiming_normal_
    assert dict(ref.kwargs) == {"nonlinearity": "relu"}
    for bad, msg in [
        ("xavier_uniform_(gain=x)", "must be Python literals"),
        ("os.system('x')", "expected a name"),
        ("nope_", "has no function"),
        ("xavier_uniform_(1, 2, 3)", "too many"),
    ]:
        with pytest.raises(UsageError, match=msg):
            parse_init(bad)


def test_build_target_rules() -> None:
    m = build_target(parse_target("torch.nn:GRU", ["8", "16"]))
    assert isinstance(m, nn.GRU)
    assert m.hidden_size == 16
    with pytest.raises(UsageError, match=r"not an nn\.Module"):
        build_target(parse_target("math:sqrt", ["4"]))
    with pytest.raises(UsageError, match="not a factory"):
        build_target(parse_target("math:pi", []))


def test_transformers_config_target_builds_the_base_model() -> None:
    code, out, err = run_main("audit", "--json", "transformers:GPT2Config", "n_layer=1", "n_embd=32", "n_head=4")
    assert code == EXIT_OK, err
    doc = json.loads(out)
    assert doc["report"]["model"] == "GPT2Model"
    c_attn = next(p for p in doc["report"]["params"] if p["name"] == "h.0.attn.c_attn.weight")
    assert c_attn["layout"]["transposed"] is True
    assert c_attn["shape"] == [32, 96]
    assert c_attn["verdict"] == "fan-independent"  # normal_(0, 0.02): packing does not change it (issue 11)
    assert "normal_0.02" in c_attn["blocks"][0]["matches"]


def test_init_option_on_a_target() -> None:
    code, out, err = run_main("audit", "torch.nn:LSTM", "16", "64", "--init", "orthogonal_")
    assert code == EXIT_OK, err
    assert "as built" in out
    assert "orthogonal_(p)" in out
    assert "chunked" in out
    assert "chunked: 8 ok" in out  # weight_ih and weight_hh, 4 gates each


def test_meta_option_and_meta_with_init() -> None:
    code, out, _ = run_main("audit", "--meta", "torch.nn:TransformerEncoderLayer", "d_model=32", "nhead=4")
    assert code == EXIT_OK
    assert "meta" in out
    assert "unmeasured" in out
    code, _, err = run_main("audit", "--meta", "--init", "xavier_uniform_")
    assert code == EXIT_USAGE
    assert "drop --meta" in err


class _BadlyAdapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(6, 4))


def test_refused_model_exit_code() -> None:
    import packedinit

    mod = type(sys)("packedinit_cli_test_target")
    mod.Bad = _BadlyAdapted  # type: ignore[attr-defined]  # a module object built on the fly
    sys.modules[mod.__name__] = mod
    packedinit.register(_BadlyAdapted)(lambda m: {"w": packedinit.Layout(0, [4, 4])})  # 8 rows, not 6
    try:
        code, out, err = run_main("audit", f"{mod.__name__}:Bad")
        assert code == EXIT_REFUSED
        assert out == ""
        assert len(err.splitlines()) == 1
        assert err.startswith("packedinit: error: ")
        assert "(6, 4)" in err
    finally:
        packedinit.unregister(_BadlyAdapted)
        del sys.modules[mod.__name__]


def test_entry_main_signature_and_help() -> None:
    assert entry_main(["--help"]) == 0
    assert entry_main(["audit", "--bogus"]) == EXIT_USAGE


def test_progress_only_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    quiet = io.StringIO()
    p = Progress(quiet)
    p.step("auditing")(1, 10, "x")
    p.clear()
    assert quiet.getvalue() == ""
    loud = Tty()
    p = Progress(loud)
    p.step("auditing")(3, 10, "layer.3.weight")
    text = loud.getvalue()
    assert text.startswith("\r")
    assert "[3/10] layer.3.weight" in text
    p.clear()
    assert loud.getvalue().endswith("\r")


def test_demo_output_is_deterministic() -> None:
    a: Any = run_main("audit")
    b: Any = run_main("audit")
    assert a[0] == EXIT_OK
    assert a[1] == b[1]
