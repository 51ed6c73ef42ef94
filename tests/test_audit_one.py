"""One audit everywhere (issue 17 item 4) and "cannot tell" when there is nothing to measure (issue 20 item 4)."""

from __future__ import annotations

import importlib
import io
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import packedinit
from packedinit import Layout, audit
from packedinit.cli.command import main
from packedinit.cli.options import EXIT_CANNOT_TELL, EXIT_OK, EXIT_PACKED, EXIT_USAGE


def run_main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


NANOGPT = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Attn(nn.Module):
        def __init__(self, e: int = 64) -> None:
            super().__init__()
            self.c_attn = nn.Linear(e, 3 * e)
            self.c_proj = nn.Linear(e, e)


    def build() -> nn.Module:
        model = nn.Sequential(Attn(), Attn())
        for p in model.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        return model
    """
)


@pytest.fixture
def nanogpt_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "i17_nanogpt.py").write_text(NANOGPT)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("i17_nanogpt")  # written just above
    sys.modules.pop("i17_nanogpt", None)


# -- the CLI's verdict is the library's -------------------------------------------------------------------
def test_cli_finds_what_the_library_finds_on_a_looks_packed_module(nanogpt_module: Any) -> None:
    torch.manual_seed(0)
    lib = audit(nanogpt_module.build())
    assert lib.affected == ("0.c_attn.weight", "1.c_attn.weight")
    code, out, _ = run_main("audit", "--check", "--json", "i17_nanogpt:build")
    assert code == EXIT_PACKED  # was 0: "no packed parameters found"
    doc = json.loads(out)["report"]
    assert doc["affected"] == list(lib.affected)
    assert [s["name"] for s in doc["suspects"]] == [s.name for s in lib.suspects]
    assert doc["fix"] == lib.fix()


@pytest.mark.parametrize("fn", ["xavier_uniform_", "kaiming_normal_", "orthogonal_", "normal_(std=0.02)"])
def test_init_adds_columns_but_never_changes_the_as_built_verdict(fn: str) -> None:
    target = ["torch.nn:MultiheadAttention", "embed_dim=64", "num_heads=4"]
    plain = run_main("audit", "--check", *target)
    code, out, _ = run_main("audit", "--check", "--init", fn, *target)
    assert plain[0] == code == EXIT_PACKED  # kaiming_normal_ used to flip it to 0
    assert "answer for the model as built (its own default init):\naffected: 1 packed parameter" in out
    code, out, _ = run_main("audit", "--json", "--init", fn, *target)
    doc = json.loads(out)
    assert doc["report"]["affected"] == ["in_proj_weight"]
    assert [s["name"] for s in doc["scenarios"]][1:] == [f"{fn.partition('(')[0]}(p)", "chunked"]


@pytest.mark.parametrize(("word", "reverse"), [("false", False), ("FALSE", False), ("True", True), ("tRuE", True)])
def test_cli_booleans_take_true_and_false_in_any_case(word: str, reverse: bool) -> None:
    code, out, _ = run_main("audit", "--json", "torch.nn:GRU", "8", "16", f"bidirectional={word}")
    assert code == EXIT_OK
    names = [p["name"] for p in json.loads(out)["report"]["params"]]
    assert any(n.endswith("_reverse") for n in names) is reverse  # 'false' built a bidirectional GRU before


@pytest.mark.parametrize("word", ["no", "off", "yes", "n"])
def test_cli_refuses_a_yes_no_word(word: str) -> None:
    code, _, err = run_main("audit", "torch.nn:GRU", "8", "16", f"bidirectional={word}")
    assert code == EXIT_USAGE
    assert f"argument bidirectional: '{word}' is ambiguous; write true or false (any case)" in err


# -- words: summary, undecided ------------------------------------------------------------------------
def test_the_summary_never_says_nothing_is_packed_above_a_looks_packed_line(nanogpt_module: Any) -> None:
    text = str(audit(nanogpt_module.build()))
    assert "no packed parameters found" not in text
    assert "no adapter or annotation describes a packed parameter; some look packed (below)." in text
    assert "AFFECTED" in text


def test_undecided_states_the_true_reason() -> None:
    torch.manual_seed(0)
    rep = audit(nn.LSTM(64, 128, num_layers=2, bidirectional=True))  # layer 1: xavier on (4H, 2H) == torch's default
    assert rep.undecided
    assert "too few values" not in rep.answer()
    assert f"({len(rep.undecided)} undecided: {len(rep.undecided)} indistinguishable" in rep.answer()
    for name in rep.undecided:
        assert rep[name].detail.endswith("(indistinguishable: the same distribution here)")
    tiny = audit(nn.MultiheadAttention(4, 1))  # 16 values per block
    assert "too few values to tell" in tiny["in_proj_weight"].detail or tiny["in_proj_weight"].verdict != "undecided"


# -- cannot tell (issue 20 item 4) ----------------------------------------------------------------------
def test_an_all_meta_model_cannot_tell_and_check_does_not_pass_silently() -> None:
    rep = audit(nn.MultiheadAttention(64, 4, device="meta"))
    assert rep.cannot_tell == ("in_proj_weight",)
    assert rep.answer().startswith("cannot tell: 1 packed parameter(s) have no values to measure (in_proj_weight: meta")
    assert rep.to_dict()["cannot_tell"] == ["in_proj_weight"]
    target = ("torch.nn:MultiheadAttention", "embed_dim=64", "num_heads=4")
    code, out, err = run_main("audit", "--check", "--meta", *target)
    assert code == EXIT_CANNOT_TELL  # was 0
    assert "packedinit: error: --check cannot tell: cannot tell: 1 packed parameter(s)" in err
    assert "answer: cannot tell" in out
    code, _, _ = run_main("audit", "--meta", *target)
    assert code == EXIT_OK  # without --check the audit just reports


def test_an_annotated_int8_weight_cannot_tell() -> None:
    lin = nn.Linear(16, 48)
    lin.weight = nn.Parameter(torch.randint(-8, 8, (48, 16), dtype=torch.int8), requires_grad=False)
    packedinit.annotate(lin, weight=Layout(0, [16, 16, 16]))
    rep = audit(lin)
    assert rep.affected == ()
    assert rep.cannot_tell == ("weight",)
    assert rep.answer().startswith("cannot tell: 1 packed parameter(s) have no values to measure (weight: torch.int8")


def test_one_nan_in_mha_is_measured_around_and_still_affected() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 4)
    with torch.no_grad():
        mha.in_proj_weight[0, 0] = float("nan")
        mha.in_proj_weight[70, 3] = float("inf")
    rep = audit(mha)
    p = rep["in_proj_weight"]
    assert p.verdict == "packed"  # was "unknown", and the answer "not affected"
    assert p.non_finite == 2
    assert p.note == "2 nan/inf value(s) left out of the statistics"
    assert rep.affected == ("in_proj_weight",)
    assert "1 parameter(s) hold nan/inf (in_proj_weight): measured around those values" in rep.answer()
    clean = nn.MultiheadAttention(64, 4)
    torch.manual_seed(0)
    clean = nn.MultiheadAttention(64, 4)
    q = audit(clean)["in_proj_weight"].blocks[0]
    assert abs((p.blocks[0].std or 0) - (q.std or 0)) < 1e-3  # the other 4095 values of q read as before


def test_a_block_of_only_nan_cannot_tell() -> None:
    mha = nn.MultiheadAttention(8, 2)
    with torch.no_grad():
        mha.in_proj_weight.fill_(float("nan"))
    rep = audit(mha)
    assert rep["in_proj_weight"].verdict == "unmeasured"
    assert rep["in_proj_weight"].detail == "unmeasured: every value is nan or inf"
    assert rep.answer().startswith("cannot tell")


def test_the_audit_page_shows_what_its_fix_example_prints(capsys: pytest.CaptureFixture[str]) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "pages" / "audit.md").read_text()
    section = page.partition("## Every printed fix works")[2].partition("\n## ")[0]
    code = section.partition("```python\n")[2].partition("```")[0]
    shown = section.partition("```text\n")[2].partition("```")[0]
    exec(compile(code, "audit.md", "exec"), {"__name__": "__docs__"})  # our own page's example
    assert shown.count("\n") == 4
    assert capsys.readouterr().out == shown
