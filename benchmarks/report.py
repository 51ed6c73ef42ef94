"""Outputs: JSON (machine), a Markdown table, a PNG plot, and splicing the table into a docs page."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "SCHEMA",
    "fmt_time",
    "fmt_bytes",
    "fmt_ratio",
    "summary",
    "to_json",
    "markdown",
    "plot",
    "splice",
    "write_all",
]

SCHEMA = "packedinit-bench/1"


def fmt_time(seconds: float | None) -> str:
    """``0.000123`` -> ``"123 us"``; ``1.5`` -> ``"1.50 s"``; ``None``/nan -> ``"-"``."""
    if seconds is None or seconds != seconds:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms" if seconds * 1e3 < 100 else f"{seconds * 1e3:.0f} ms"
    return f"{seconds * 1e6:.3g} us"


def fmt_bytes(n: int | None) -> str:
    """Binary units: ``3145728`` -> ``"3.0 MiB"``; ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def fmt_ratio(r: float | None) -> str:
    """``1.0123`` -> ``"1.01x"``; ``None``/nan -> ``"-"``."""
    if r is None or r != r:
        return "-"
    return f"{r:.2f}x" if r < 100 else f"{r:.0f}x"


def _fmt_num(x: float | None, digits: int = 3) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:.{digits}g}"


def _v(row: dict[str, Any], name: str) -> dict[str, Any] | None:
    v = row.get("variants", {}).get(name)
    return v if v is not None and v.get("status") == "ok" else None


def _variant_cell(row: dict[str, Any], name: str, key: str = "ratio_to_plain") -> str:
    v = row.get("variants", {}).get(name)
    if v is None:
        return "-"
    if v.get("status") == "ok":
        return fmt_ratio(v.get(key))
    return {"n/a": "n/a", "unavailable": "unavailable", "error": "**error**"}.get(v.get("status", ""), "-")


def _target_cell(row: dict[str, Any]) -> str:
    t = row.get("target")
    if not t:
        return "-"
    mark = {True: "met", False: "**missed**", None: "-"}[t.get("met")]
    return f"<= {t['limit']:.2f}: {mark}"


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per target rule: how many rows met / missed it and the worst chunked ratio; plus counts by status."""
    rules: dict[str, dict[str, Any]] = {}
    for r in rows:
        t = r.get("target")
        if not t or t.get("met") is None:
            continue
        s = rules.setdefault(t["rule"], {"limit": t["limit"], "met": 0, "missed": 0, "worst": None, "worst_row": ""})
        s["met" if t["met"] else "missed"] += 1
        if s["worst"] is None or t["ratio"] > s["worst"]:
            s["worst"] = t["ratio"]
            s["worst_row"] = f"{r['case']} {r['dtype']} {r['fn']}"
    status: dict[str, int] = {}
    for r in rows:
        status[r["status"]] = status.get(r["status"], 0) + 1
    return {"targets": rules, "status": status}


def to_json(env: dict[str, Any], config: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """The machine-readable result: environment, config, summary and every row."""
    doc = {"schema": SCHEMA, "environment": env, "config": config, "summary": summary(rows), "rows": list(rows)}
    return json.dumps(doc, indent=1, sort_keys=False, allow_nan=False)


def _env_lines(env: dict[str, Any]) -> list[str]:
    threads = f"{env.get('torch_threads')} torch threads ({env.get('cpus_usable')} usable CPUs)"
    load = env.get("loadavg_start")
    load_s = f", load average at start {load[0]:.2f}" if load else ""
    commit = str(env.get("git_commit"))
    dirty = " (with uncommitted changes)" if commit.endswith("+dirty") else ""
    lines = [
        f"- device: **{env.get('device_name')}** (`{env.get('device')}`), {threads}{load_s}",
        f"- torch {env.get('torch')}, packedinit {env.get('packedinit')}, Python {env.get('python')}, "
        f"commit `{commit[:12]}`{dirty}",
        f"- measured {env.get('utc')} with `{env.get('command')}`",
    ]
    if env.get("cuda"):
        lines.insert(1, f"- CUDA {env.get('cuda')}, capability {env.get('gpu_capability')}, CPU {env.get('cpu_model')}")
    return lines


def markdown(env: dict[str, Any], rows: Sequence[dict[str, Any]], plot_name: str | None = None) -> str:
    """A self-contained Markdown report: environment, target summary, three tables."""
    cuda = str(env.get("device", "")).startswith("cuda")
    out: list[str] = _env_lines(env)
    out.append("")
    s = summary(rows)
    if s["targets"]:
        out += [
            "| target (chunked / plain, median of paired ratios) | rows met | rows missed | worst (row) |",
            "|---|---|---|---|",
        ]
        for rule, t in s["targets"].items():
            out.append(f"| {rule} | {t['met']} | {t['missed']} | {fmt_ratio(t['worst'])} ({t['worst_row']}) |")
        out.append("")
    if plot_name:
        out += [f"![chunked / plain per case]({plot_name})", ""]
    counts = "launches plain / chunked" if cuda else "ops plain / chunked"
    head = (
        "| case | dtype | fn | elements | plain | chunked | chunked/plain | naive/plain | timm/plain "
        f"| chunked GB/s | % of fill_ | fill_ GB/s | chunked peak mem | {counts} "
        "| compute ops plain / CPU plan / CUDA plan (blocks) | n | target |"
    )
    sep = "|" + "---|" * (head.count("|") - 1)
    measured = [r for r in rows if r["status"] in ("ok", "error")]  # skipped/unsupported: listed below
    groups = [
        ("Packed tensors", [r for r in measured if r["kind"] != "model" and r["fn"] != "orthogonal_"]),
        ("Whole models", [r for r in measured if r["kind"] == "model" and r["fn"] != "orthogonal_"]),
        ("orthogonal_ (QR per block vs whole)", [r for r in measured if r["fn"] == "orthogonal_"]),
    ]
    for title, group in groups:
        if not group:
            continue
        out += [f"#### {title}", "", head, sep]
        for r in group:
            out.append(_row_line(r, cuda))
        out.append("")
    notes = [r for r in rows if r["status"] != "ok"]
    if notes:
        out += ["#### Rows not measured or with errors", ""]
        out += [f"- {r['case']} {r['dtype']} {r['fn']}: {r['status']}: {r['note']}" for r in notes]
        for r in rows:
            for name, v in r.get("variants", {}).items():
                if v.get("status") in ("error", "unavailable"):
                    out.append(f"- {r['case']} {r['dtype']} {r['fn']} / {name}: {v['status']}: {v['note']}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _launches(plain: dict[str, Any] | None, ch: dict[str, Any] | None, blocks: int) -> str:
    """Compute ops (a kernel launch each on a GPU) of plain, of packedinit's CPU plan and of its CUDA plan."""

    def get(v: dict[str, Any] | None, key: str) -> str:
        return "-" if v is None or v.get(key) is None else str(v[key])

    tail = f" ({blocks})" if blocks else ""
    return f"{get(plain, 'launches')} / {get(ch, 'launches')} / {get(ch, 'device_launches')}{tail}"


def _row_line(r: dict[str, Any], cuda: bool) -> str:
    plain, ch, fill = _v(r, "plain"), _v(r, "chunked"), _v(r, "fill")
    key = "kernels" if cuda else "ops"

    def count(v: dict[str, Any] | None) -> str:
        return "-" if v is None or v.get(key) is None else str(v[key])

    cells = [
        r["case"],
        r["dtype"],
        r["fn"],
        f"{r['numel']:,}" if r.get("numel") else "-",
        fmt_time(plain["median_s"]) if plain else r["status"],
        fmt_time(ch["median_s"]) if ch else _variant_cell(r, "chunked"),
        _variant_cell(r, "chunked"),
        _variant_cell(r, "naive"),
        _variant_cell(r, "timm"),
        _fmt_num(ch["gbps"]) if ch else "-",
        f"{ch['pct_roofline']:.1f}" if ch and ch.get("pct_roofline") is not None else "-",
        _fmt_num(fill["gbps"]) if fill else "-",
        fmt_bytes(ch.get("peak_mem_bytes")) if ch else "-",
        f"{count(plain)} / {count(ch)}",
        _launches(plain, ch, r.get("blocks", 0)),
        str(r.get("repeats", 0)),
        _target_cell(r),
    ]
    return "| " + " | ".join(cells) + " |"


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str) -> str | None:
    """Write a PNG of chunked (bars), naive (x) and timm (|) ratios to plain; ``None`` on success.

    matplotlib is optional: without it nothing is written and the reason is returned.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib is not installed ({e}); pip install 'packedinit[plot]'"
    rows = [r for r in rows if _v(r, "plain") is not None and r["fn"] != "orthogonal_"]
    dtypes = sorted({r["dtype"] for r in rows}) or ["float32"]
    fns = sorted({r["fn"] for r in rows})
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig_h = max(3.0, 0.32 * len(cases) * max(1, len(fns)) + 1.5)
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), fig_h), squeeze=False, sharey=True)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]
    height = 0.8 / max(1, len(fns))
    for ax, dt in zip(axes[0], dtypes, strict=False):
        for k, fn in enumerate(fns):
            ys, ch, nv, tm = [], [], [], []
            for i, c in enumerate(cases):
                r = next((r for r in rows if r["case"] == c and r["fn"] == fn and r["dtype"] == dt), None)
                if r is None:
                    continue
                y = i + (k - (len(fns) - 1) / 2) * height
                ys.append(y)
                ch.append(_ratio(r, "chunked"))
                nv.append(_ratio(r, "naive"))
                tm.append(_ratio(r, "timm"))
            color = colors[k % len(colors)]
            # bars grow from 1.0: right of the line is slower than plain, left is faster
            widths = [x - 1.0 if x == x else 0.0 for x in ch]
            ax.barh(ys, widths, height=height * 0.9, left=1.0, color=color, label=f"chunked, {fn}")
            ax.scatter(nv, ys, marker="x", color=color, s=18, label=f"naive, {fn}")
            ax.scatter(tm, ys, marker="|", color="black", s=40, label="timm single bound" if k == 0 else None)
        for limit, style in ((1.0, "-"), (1.03, "--"), (1.10, "-."), (1.15, ":")):
            ax.axvline(limit, color="gray", linestyle=style, linewidth=0.8)
        ax.set_xscale("log")
        finite = [x for r in rows for x in (_ratio(r, "chunked"), _ratio(r, "naive"), _ratio(r, "timm")) if x == x]
        lo, hi = min([*finite, 0.9]) * 0.95, max([*finite, 1.2]) * 1.05
        ax.set_xlim(lo, hi)
        ticks = [t for t in (0.25, 0.5, 0.75, 0.9, 1.0, 1.15, 1.5, 2, 3, 5, 10, 20, 50, 100) if lo <= t <= hi]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_title(f"{dt}")
        ax.set_xlabel("time / plain whole-tensor init (log); lines at 1, 1.03, 1.10, 1.15")
        ax.set_yticks(range(len(cases)))
        ax.set_yticklabels(cases, fontsize=8)
        ax.invert_yaxis()
        ax.grid(axis="x", which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 0.98))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _ratio(r: dict[str, Any], name: str) -> float:
    v = _v(r, name)
    x = v.get("ratio_to_plain") if v else None
    return float("nan") if x is None else float(x)


_MARK = "<!-- bench:{tag}:{end} -->"


def splice(page: str, tag: str, body: str) -> str:
    """Replace the text between ``<!-- bench:TAG:begin -->`` and ``<!-- bench:TAG:end -->`` in ``page``.

    Raises:
        ValueError: the page lacks the two markers.
    """
    begin, end = _MARK.format(tag=tag, end="begin"), _MARK.format(tag=tag, end="end")
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(page):
        raise ValueError(f"the page has no '{begin}' ... '{end}' markers to put the {tag} results between")
    return pattern.sub(lambda _: f"{begin}\n{body.rstrip()}\n{end}", page, count=1)


def write_all(
    out_dir: Path,
    tag: str,
    env: dict[str, Any],
    config: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    *,
    make_plot: bool = True,
    docs_page: Path | None = None,
    plot_dir: Path | None = None,
) -> list[str]:
    """Write ``TAG.json``, ``TAG.md`` and a PNG, and splice the page; return messages.

    The PNG is ``out_dir/TAG.png``, or ``plot_dir/bench_TAG.png`` when ``plot_dir`` is given
    (a docs site's image folder, while JSON and Markdown stay out of the site's pages).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    msgs: list[str] = []
    (out_dir / f"{tag}.json").write_text(to_json(env, config, rows) + "\n")
    png = out_dir / f"{tag}.png" if plot_dir is None else plot_dir / f"bench_{tag}.png"
    plot_msg = plot(rows, png, f"packedinit init cost on {env.get('device_name')} ({tag})") if make_plot else "no plot"
    if plot_msg is not None:
        msgs.append(plot_msg)
    md_plot = os.path.relpath(png, out_dir) if plot_msg is None else None
    (out_dir / f"{tag}.md").write_text(markdown(env, rows, md_plot))
    msgs.append(f"wrote {out_dir / (tag + '.json')}, {tag}.md" + ("" if plot_msg else f", {png}"))
    if docs_page is not None:
        rel = os.path.relpath(png, docs_page.parent) if plot_msg is None else None
        text = docs_page.read_text()
        docs_page.write_text(splice(text, tag, markdown(env, rows, rel)))
        msgs.append(f"updated {docs_page} between the bench:{tag} markers")
    return msgs
