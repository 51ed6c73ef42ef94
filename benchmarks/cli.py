"""Command line: ``python -m benchmarks [--smoke] [--out DIR] [filters] [effort]``."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .cases import build_cases, select_cases
from .envinfo import environment
from .probes import memory_method
from .report import SCHEMA, write_all
from .runner import DTYPES, FNS, ROW_FNS, Config, Row, run_all

__all__ = ["main", "parse_args", "config_from_args"]


def _split(values: Sequence[str] | None) -> list[str]:
    """``["a,b", "c"]`` -> ``["a", "b", "c"]``."""
    out: list[str] = []
    for v in values or ():
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse the command line (see ``python -m benchmarks --help``)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=(
            "Time packedinit's per-block init against plain torch.nn.init, a naive per-view loop, the "
            "timm-style single corrected bound and the fill_/copy_ roofline, interleaved in one run. "
            "Writes TAG.json, TAG.md and TAG.png per device into --out."
        ),
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats: checks the harness in seconds")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default bench-out)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--case", action="append", help="glob(s) on case name or family, e.g. 'mha*', 'model'")
    p.add_argument("--fn", action="append", help=f"init fn(s): {', '.join(FNS)}, or {ROW_FNS[-1]} (default: all)")
    p.add_argument("--dtype", action="append", help=f"dtype(s): {', '.join(DTYPES)} (default: all)")
    p.add_argument("--device", action="append", help="cpu and/or cuda (default: cpu, plus cuda when available)")
    p.add_argument("--repeats", type=int, help="interleaved repeats per row (default 21; smoke 3)")
    p.add_argument("--min-repeats", type=int, help="repeats kept even past the row budget (default 5; smoke 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per variant before timing (default 1)")
    p.add_argument("--min-sample-ms", type=float, default=5.0, help="each sample loops a call to last this long")
    p.add_argument("--max-row-seconds", type=float, help="time budget per row (default 30 on cpu, 10 on cuda)")
    p.add_argument(
        "--max-call-seconds",
        type=float,
        help="skip a row (reported as skipped) when one plain call takes longer than this",
    )
    p.add_argument(
        "--ortho-max-numel",
        type=int,
        help="skip orthogonal_ on tensors larger than this (default 4Mi on cpu, 64Mi on cuda)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory probe")
    p.add_argument("--no-counts", action="store_true", help="skip counting dispatched ops / CUDA kernels")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--docs-page", type=Path, help="also splice the Markdown between <!-- bench:TAG:begin/end -->")
    p.add_argument("--plot-dir", type=Path, help="write the PNG as PLOT_DIR/bench_TAG.png instead of OUT/TAG.png")
    p.add_argument(
        "--from-json",
        type=Path,
        help="measure nothing: re-render Markdown/PNG (and --docs-page) from a JSON this tool wrote",
    )
    p.add_argument("--tag", help="output file stem (default: the device type, 'cpu' or 'cuda')")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default; smoke: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no per-row progress on stderr")
    return p.parse_args(list(argv))


def config_from_args(ns: argparse.Namespace, device: torch.device) -> Config:
    """The measurement effort for ``device`` from the parsed flags (smoke or full defaults)."""
    cuda = device.type == "cuda"
    smoke = bool(ns.smoke)
    return Config(
        repeats=ns.repeats if ns.repeats is not None else (3 if smoke else 21),
        min_repeats=ns.min_repeats if ns.min_repeats is not None else (2 if smoke else 5),
        warmup=max(1, ns.warmup),
        min_sample_s=(0.0 if smoke else ns.min_sample_ms / 1e3),
        max_row_s=ns.max_row_seconds if ns.max_row_seconds is not None else (2.0 if smoke else 10.0 if cuda else 30.0),
        ortho_max_numel=ns.ortho_max_numel if ns.ortho_max_numel is not None else (64 if cuda else 4) * 2**20,
        max_call_s=ns.max_call_seconds,
        memory=not ns.no_memory,
        counts=not ns.no_counts,
        seed=ns.seed,
        verbose=not ns.quiet,
    )


def _devices(names: list[str]) -> list[torch.device]:
    if not names:
        return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    devs = []
    for n in names:
        d = torch.device(n)
        if d.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("python -m benchmarks: --device cuda asked for, but torch.cuda.is_available() is False")
        if d.type not in ("cpu", "cuda"):
            raise SystemExit(f"python -m benchmarks: unsupported --device {n!r}; use cpu or cuda")
        devs.append(d)
    return devs


def _pick(names: list[str], known: Sequence[str], what: str) -> list[str]:
    if not names:
        return list(known)
    out = []
    for n in names:
        hits = [k for k in known if fnmatch.fnmatchcase(k, n) or k.startswith(n)]
        if not hits:
            raise SystemExit(f"python -m benchmarks: unknown {what} {n!r}; known: {', '.join(known)}")
        out += [h for h in hits if h not in out]
    return out


def _render(ns: argparse.Namespace) -> int:
    doc = json.loads(Path(ns.from_json).read_text())
    if doc.get("schema") != SCHEMA:
        raise SystemExit(f"python -m benchmarks: {ns.from_json} is not a {SCHEMA} result")
    env, rows = doc["environment"], doc["rows"]
    tag = ns.tag or torch.device(env["device"]).type
    for msg in write_all(
        ns.out, tag, env, doc["config"], rows, make_plot=not ns.no_plot, docs_page=ns.docs_page, plot_dir=ns.plot_dir
    ):
        print(msg)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when every row ran, 1 when a variant raised (the report says which)."""
    args = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(args)
    if ns.from_json is not None:
        return _render(ns)
    cases = select_cases(build_cases(smoke=ns.smoke), _split(ns.case))
    if ns.list:
        for c in cases:
            print(f"{c.name:<28} {c.kind:<10} {c.description}")
        return 0
    if not cases:
        raise SystemExit(f"python -m benchmarks: no case matches {_split(ns.case)}; see --list")
    fns = _pick(_split(ns.fn), list(ROW_FNS), "--fn")
    dtypes = _pick(_split(ns.dtype), list(DTYPES), "--dtype")
    devices = _devices(_split(ns.device))
    if ns.threads or ns.smoke:
        torch.set_num_threads(ns.threads or 1)  # smoke: tiny ops, no thread-pool wake-ups on a busy machine
    if ns.tag and len(devices) > 1:
        raise SystemExit("python -m benchmarks: --tag names one output; give one --device with it")
    failed = False
    for device in devices:
        cfg = config_from_args(ns, device)
        env = environment(device, args)
        env["memory_method"] = memory_method(device) if cfg.memory else "off"
        start = time.perf_counter()
        rows: list[Row] = run_all(cases, fns, dtypes, device, cfg)
        env["seconds"] = round(time.perf_counter() - start, 1)
        env["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        config = dataclasses.asdict(cfg) | {"cases": [c.name for c in cases], "fns": fns, "dtypes": dtypes}
        tag = ns.tag or device.type
        for msg in write_all(
            ns.out,
            tag,
            env,
            config,
            [r.to_json() for r in rows],
            make_plot=not ns.no_plot,
            docs_page=ns.docs_page,
            plot_dir=ns.plot_dir,
        ):
            print(msg)
        errors = [r for r in rows if r.status == "error"]
        for r in errors:
            bad = [f"{k}: {v.note}" for k, v in r.variants.items() if v.status == "error"] or [r.note]
            print(f"ERROR {r.case} {r.dtype} {r.fn}: " + "; ".join(bad), file=sys.stderr)
        failed = failed or bool(errors)
        print(f"{device}: {len(rows)} rows in {env['seconds']} s, {len(errors)} with errors")
    return 1 if failed else 0
