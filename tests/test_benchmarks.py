"""The benchmark harness's pure parts: cases, naive views, metrics, interleaving, outputs.

No timing assertions: timing targets live in benchmarks/, never in tests.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))

from benchmarks import cli, metrics, report  # noqa: E402  (needs the sys.path line above)
from benchmarks.cases import Case, build_cases, layout_kind, materialize, naive_views, select_cases  # noqa: E402
from benchmarks.probes import count_ops, memory_method, peak_memory  # noqa: E402
from benchmarks.runner import FNS, Config, bench_row, build_variants  # noqa: E402
from benchmarks.timing import CpuClock, calibrate, run_interleaved  # noqa: E402
from packedinit import Layout  # noqa: E402

CPU = torch.device("cpu")


def by_name(cases: list[Case]) -> dict[str, Case]:
    return {c.name: c for c in cases}


# -- cases --------------------------------------------------------------------------------------


def test_full_cases_cover_the_issue() -> None:
    cases = by_name(build_cases())
    for e in (1024, 4096, 8192):
        assert cases[f"mha_in_proj_E{e}"].tensors[0].shape == (3 * e, e)
    gqa = cases["gqa_qkv_64q8kv_d128"].tensors[0]
    assert gqa.shape == (64 * 128 + 2 * 8 * 128, 64 * 128)
    assert gqa.layout is not None
    assert gqa.layout.sizes == (8192, 1024, 1024)
    small = cases["small_10000x64x64"]
    assert small.copies == 10_000
    assert small.tensors[0].shape == (64, 64)
    assert small.kind == "overhead"
    assert {c.family for c in cases.values()} >= {
        "mha",
        "lstm",
        "gru",
        "gqa",
        "neox",
        "conv1d",
        "moe",
        "small",
        "model",
    }
    assert len(cases) == len(build_cases()), "case names must be unique"


@pytest.mark.parametrize("smoke", [True, False])
def test_every_layout_fits_its_shape(smoke: bool) -> None:
    for case in build_cases(smoke=smoke):
        for spec in case.tensors:
            if spec.layout is not None:
                spec.layout.check(spec.shape, param=spec.name)  # raises PackedInitError on a mismatch


def test_kinds() -> None:
    cases = by_name(build_cases())
    assert cases["mha_in_proj_E1024"].kind == "contiguous"
    assert cases["moe_mixtral_8x1024x2048"].kind == "contiguous"
    assert cases["lstm_stack_H1024_L4"].kind == "contiguous"
    for name in ("neox_qkv_E1024", "gpt2_conv1d_E1024", "dim1_split_E1024", "moe_gptoss_8x1024x2048"):
        assert cases[name].kind == "scratch", name
    assert cases["model_encoder_L12_d768"].kind == "model"
    assert layout_kind((6, 4), None) == "contiguous"
    assert layout_kind((6, 4), Layout(0, [2, 2, 2])) == "contiguous"
    assert layout_kind((6, 4), Layout(0, [1, 1, 1], groups=2)) == "scratch"


@pytest.mark.parametrize(
    ("name", "low", "high"), [("model_encoder_L12_d768", 80e6, 90e6), ("model_gpt2_L12_d768", 90e6, 110e6)]
)
def test_whole_models_have_the_advertised_size(name: str, low: float, high: float) -> None:
    case = by_name(build_cases())[name]
    assert case.model is not None
    with torch.device("meta"):
        model = case.model()
    n = sum(p.numel() for p in model.parameters() if p.dim() > 1)
    assert low <= n <= high
    assert n == case.model_params


def test_select_cases_by_name_or_family() -> None:
    cases = build_cases(smoke=True)
    assert [c.name for c in select_cases(cases, ["mha*"])] == ["mha_in_proj_E32"]
    assert {c.family for c in select_cases(cases, ["model"])} == {"model"}
    assert select_cases(cases, None) == cases
    assert select_cases(cases, ["nothing-matches"]) == []


LAYOUTS = [
    ((12, 4), Layout(0, [4, 4, 4])),
    ((12, 4), Layout(0, [2, 2, 2], groups=2)),  # NeoX-style interleaved
    ((4, 12), Layout(1, [4, 4, 4], transposed=True)),  # GPT-2 Conv1D
    ((4, 12), Layout(1, [4, 4, 4])),
    ((3, 8, 4), Layout(1, [4, 4], batch_dims=1)),  # Mixtral experts
    ((3, 4, 8), Layout(2, [1, 1], groups=4, transposed=True, batch_dims=1)),  # GPT-OSS experts
    ((5, 6), None),
]


@pytest.mark.parametrize(("shape", "layout"), LAYOUTS)
def test_naive_views_cover_every_element_once(shape: tuple[int, ...], layout: Layout | None) -> None:
    t = torch.zeros(shape)
    views = naive_views(t, layout)
    for v in views:
        assert v.data_ptr() >= t.data_ptr()  # views, never copies
        v.add_(1.0)
    assert torch.equal(t, torch.ones(shape))
    if layout is not None and layout.groups > 1 and min(layout.sizes) > 1:
        assert len(views) == layout.groups * layout.num_parts  # per-head loop
    elif layout is not None:
        assert len(views) == len(layout.blocks(shape))


# -- metrics ------------------------------------------------------------------------------------


def test_metrics_arithmetic() -> None:
    assert metrics.median([3.0, 1.0, 2.0]) == 2.0
    assert math.isnan(metrics.median([]))
    assert metrics.iqr([1.0]) == 0.0
    assert metrics.iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.0)
    assert metrics.gbps(2_000_000_000, 2.0) == pytest.approx(1.0)
    assert math.isnan(metrics.gbps(10, 0.0))
    assert metrics.pct_of_roofline(2.0, 1.0) == pytest.approx(50.0)


@given(st.lists(st.floats(0.001, 10.0), min_size=1, max_size=20), st.floats(0.5, 2.0))
def test_paired_ratio_cancels_drift(base: list[float], k: float) -> None:
    # a variant that is always k x the baseline of the same repeat, however the baseline drifts
    assert metrics.paired_ratio([k * b for b in base], base) == pytest.approx(k)


def test_targets_follow_the_issue() -> None:
    t = metrics.target_for("contiguous", "xavier_uniform_", 3 * 1024 * 1024, 1024)
    assert t is not None
    assert t.limit == 1.03
    assert metrics.target_for("contiguous", "xavier_uniform_", 999_999, 1024) is None
    t = metrics.target_for("scratch", "kaiming_normal_", 10**6, 1024)
    assert t is not None
    assert t.limit == 1.15
    assert metrics.target_for("scratch", "kaiming_normal_", 10**6, 768) is None
    t = metrics.target_for("model", "trunc_normal_", 10**8, 768)
    assert t is not None
    assert t.limit == 1.10
    t = metrics.target_for("overhead", "orthogonal_", 4096, 64)
    assert t is not None
    assert t.limit == 1.00
    assert metrics.target_for("overhead", "xavier_uniform_", 4096, 64) is None
    assert t.met(0.9) is True
    assert t.met(1.2) is False
    assert t.met(float("nan")) is None


# -- timing (order and stopping rules only) -----------------------------------------------------


def test_run_interleaved_alternates_order_and_respects_min_repeats() -> None:
    calls: list[str] = []
    fns = {n: (lambda n=n: calls.append(n)) for n in "abc"}
    s = run_interleaved(CpuClock(), fns, {"a": 1, "b": 2, "c": 1}, repeats=4)
    assert calls == list("abbc" + "cbba" + "abbc" + "cbba")
    assert s.repeats == 4
    assert all(len(v) == 4 for v in s.times.values())
    calls.clear()
    s = run_interleaved(CpuClock(), fns, {"a": 1, "b": 1, "c": 1}, repeats=50, min_repeats=3, budget_s=0.0)
    assert s.repeats == 3
    assert len(calls) == 9


def test_calibrate_never_returns_zero_calls() -> None:
    t, number = calibrate(CpuClock(), lambda: None, 0.0)
    assert number == 1
    assert t >= 0


# -- probes -------------------------------------------------------------------------------------


def test_peak_memory_sees_a_temporary_allocation() -> None:
    n = 8 * 2**20  # 32 MiB of float32, freed before the call returns
    got = peak_memory(lambda: torch.ones(n).sum(), CPU)
    assert "peak RSS" in memory_method(CPU)
    assert got >= 30 * 2**20


def test_count_ops_counts_dispatched_ops() -> None:
    t = torch.empty(8, 4)
    assert count_ops(lambda: torch.nn.init.xavier_uniform_(t)) == 1  # one uniform_
    assert count_ops(lambda: t.fill_(1.0)) == 1


# -- variants and a real (tiny) row -------------------------------------------------------------


def test_variants_write_what_they_claim() -> None:
    case = by_name(build_cases(smoke=True))["mha_in_proj_E32"]
    m = materialize(case, torch.float32, CPU)
    v = build_variants(m, "xavier_uniform_")
    assert set(v) == {"plain", "chunked", "naive", "timm", "fill", "copy"}
    bound = math.sqrt(6 / (32 + 32))  # per q/k/v block
    for name in ("chunked", "timm"):
        fn = v[name]
        assert callable(fn)
        fn()
        w = m.tensors[0]
        assert w.abs().max() <= bound
        assert w.abs().max() > math.sqrt(6 / (96 + 32))
    fill = v["fill"]
    assert callable(fill)
    fill()
    assert torch.equal(m.tensors[0], torch.ones(96, 32))
    assert isinstance(build_variants(m, "trunc_normal_")["timm"], str)  # n/a, with the reason


def test_bench_row_reports_unsupported_combinations() -> None:
    case = by_name(build_cases(smoke=True))["mha_in_proj_E32"]
    m = materialize(case, torch.bfloat16, CPU)
    cfg = Config(repeats=1, min_repeats=1, memory=False, counts=False, verbose=False)
    row = bench_row(m, "orthogonal_", "bfloat16", cfg, CpuClock())
    assert row.status == "unsupported"
    assert "geqrf" in row.note
    row = bench_row(m, "xavier_uniform_", "bfloat16", cfg, CpuClock())
    assert row.status == "ok"
    assert row.repeats == 1
    assert set(row.variants) == {"plain", "chunked", "naive", "timm", "fill", "copy"}
    assert row.variants["plain"].ratio_to_plain == pytest.approx(1.0)



@pytest.mark.parametrize("case_name", ["mha_in_proj_E32", "model_gpt2_L2_d32"])
def test_fingerprint_rows_time_the_fingerprint_against_a_float64_sum(case_name: str) -> None:
    m = materialize(by_name(build_cases(smoke=True))[case_name], torch.float32, CPU)
    cfg = Config(repeats=2, min_repeats=1, memory=False, counts=True, verbose=False, min_sample_s=0.0)
    row = bench_row(m, "fingerprint", "float32", cfg, CpuClock())
    assert row.status == "ok", row.note
    assert row.variants["chunked"].status == "ok"
    assert row.variants["naive"].status == "n/a"
    assert row.target is not None
    assert row.target["limit"] == 2.00
    target = metrics.target_for("contiguous", "fingerprint", 10**8, 4096)
    assert target is not None
    assert target.limit == 2.00


# -- outputs ------------------------------------------------------------------------------------


def test_formatting() -> None:
    assert report.fmt_time(1.5) == "1.50 s"
    assert report.fmt_time(0.0123) == "12.3 ms"
    assert report.fmt_time(0.000123) == "123 us"
    assert report.fmt_time(None) == "-"
    assert report.fmt_bytes(3 * 2**20) == "3.0 MiB"
    assert report.fmt_bytes(12) == "12 B"
    assert report.fmt_ratio(1.0123) == "1.01x"
    assert report.fmt_ratio(float("nan")) == "-"


def test_splice_replaces_only_between_markers() -> None:
    page = "intro\n<!-- bench:cpu:begin -->\nold\n<!-- bench:cpu:end -->\noutro\n"
    out = report.splice(page, "cpu", "| new |")
    assert out == "intro\n<!-- bench:cpu:begin -->\n| new |\n<!-- bench:cpu:end -->\noutro\n"
    assert report.splice(out, "cpu", "| new |") == out  # idempotent
    with pytest.raises(ValueError, match="bench:cuda:begin"):
        report.splice(page, "cuda", "x")


def test_cli_end_to_end_writes_json_markdown_png_and_the_docs_page(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text("# B\n<!-- bench:cpu:begin -->\n<!-- bench:cpu:end -->\n")
    out = tmp_path / "out"
    argv = ["--smoke", "--case", "mha*", "--case", "neox*", "--fn", "xavier", "--dtype", "float32"]
    argv += ["--repeats", "2", "--no-counts", "--quiet", "--out", str(out), "--docs-page", str(page)]
    assert cli.main(argv) == 0
    doc: dict[str, Any] = json.loads((out / "cpu.json").read_text())
    assert doc["schema"] == "packedinit-bench/1"
    env = doc["environment"]
    for key in ("device_name", "torch", "git_commit", "cpu_model", "torch_threads", "command"):
        assert env[key] not in (None, "")
    assert [(r["case"], r["fn"]) for r in doc["rows"]] == [
        ("mha_in_proj_E32", "xavier_uniform_"),
        ("neox_qkv_E32", "xavier_uniform_"),
    ]
    assert doc["rows"][1]["kind"] == "scratch"
    md = (out / "cpu.md").read_text()
    assert "| mha_in_proj_E32 | float32 | xavier_uniform_ |" in md
    assert "![" in md
    assert (out / "cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again"  # re-rendering from the JSON measures nothing and gives the same table
    assert cli.main(["--from-json", str(out / "cpu.json"), "--out", str(again), "--no-plot"]) == 0
    assert (again / "cpu.md").read_text() == md.replace("![chunked / plain per case](cpu.png)\n\n", "")
    text = page.read_text()
    assert "| neox_qkv_E32 | float32 | xavier_uniform_ |" in text
    assert "](out/cpu.png)" in text


def test_cli_rejects_unknown_names() -> None:
    with pytest.raises(SystemExit, match="unknown --fn"):
        cli.main(["--smoke", "--fn", "not_an_init"])
    with pytest.raises(SystemExit, match="no case matches"):
        cli.main(["--smoke", "--case", "nothing*"])


def test_fns_are_the_issue_s() -> None:
    assert set(FNS) == {"xavier_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_"}


def test_audit_scaling_table_has_both_rows() -> None:
    from benchmarks import audit_scaling

    rows = audit_scaling.measure(3, repeats=1)
    assert [what for what, _, _ in rows] == ["audit(model)", "audit(model, suspects=False)"]
    text = audit_scaling.table(3, rows)
    assert "n = 30" in text
    assert text.count("\n") == 4
