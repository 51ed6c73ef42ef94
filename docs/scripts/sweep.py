"""Every transformers base model, built tiny and checked: ``PYTHONPATH=. python docs/scripts/sweep.py``.

For every ``(model_type, class)`` in ``transformers.models.auto.modeling_auto.MODEL_MAPPING_NAMES``
the model's default config is shrunk (hidden 64, 1 layer, 4 heads, vocab 256, 4 experts;
nested sub-configs too) and the model is built on the meta device. A build that fails is
counted with its reason. A built model is then checked:

1. ``to_empty(device="cpu")`` then ``packedinit.reset_parameters(model, strict=True)``: passes,
   or its message is recorded (what the model's own init leaves unset);
2. ``packedinit.audit(model)`` runs and gives its one-line answer;
3. ``packedinit.infer_layouts`` on the input ``packedinit.trace.inputs.example_inputs`` builds from the
   config (token ids, pixel values, audio, video, patches and grid, time series; decoder ids for an
   encoder-decoder), compared with ``packedinit.layouts(model)`` (every weight where they disagree is
   listed; for every packed weight, whether the adapters, the forward or both describe it).

A model is *clean* when all three pass, the forward was traced, and it agrees with the adapters.
Results go to a JSON-lines file (one line per model, so a run cut short keeps what it did) and a Markdown page
(``--page``, default ``docs/pages/sweep.md``). ``--only`` limits the run to some model types
(the tests run a fast subset this way).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import packedinit
from packedinit.trace.compare import disagreements
from packedinit.trace.inputs import example_inputs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sweep_shrink beside it, however this file is loaded
from sweep_shrink import SIZES, shallow, shrink  # after the path it needs


def _trace(row: dict[str, Any], model: Any) -> None:
    """Trace ``model`` on the input example_inputs builds and compare with the adapters; into ``row``."""
    built_inputs = example_inputs(model)
    if built_inputs is None:
        row["trace"] = f"not run: no example input for main input {getattr(model, 'main_input_name', None)!r}"
        return
    model.eval()
    args, kwargs = built_inputs
    row["inputs"] = sorted(k for k in kwargs if k != "use_cache") or [type(a).__name__ for a in args]
    try:
        found = packedinit.infer_layouts(model, *args, **kwargs)
    except Exception as e:
        row["trace"] = _why(e.__cause__ or e)
        return
    claimed = packedinit.layouts(model)
    row.pop("trace", None)
    row["traced"] = len(found)
    row["packed_by_forward"] = sum(1 for f in found.values() if f.verdict == "packed")
    row["opaque"] = sum(1 for f in found.values() if f.verdict == "opaque")
    row["disagree"] = [f"{n}: {why}" for n, why in disagreements(found, claimed)]
    row["sources"] = _sources(found, claimed)


_VALUES = ("meta tensor", "expected device meta", "not on the expected device", "no data!", "without output_size")
_CPU_PARAMS = 400_000_000  # a default-width model built for real on the CPU: at most this many parameters


def _needs_values(why: str) -> bool:
    """The forward read a value (``.item()``, a mask, a device): it cannot run on meta."""
    return any(k in why for k in _VALUES)


def _trace_on_cpu(row: dict[str, Any], cls: Any, config: Any) -> None:
    """Default widths, 1 layer, vocabulary and experts shrunk, built for real on the CPU, traced (values read)."""
    config = shallow(config)
    for sub in (config, *(v for v in vars(config).values() if hasattr(v, "to_dict"))):
        for key in ("vocab_size", "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
            old = getattr(sub, key, None)
            if isinstance(old, int) and not isinstance(old, bool) and old > SIZES[key]:
                with contextlib.suppress(AttributeError, TypeError, ValueError):
                    setattr(sub, key, SIZES[key])
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > _CPU_PARAMS:
        row["trace"] = f"{row.get('trace')} (not built on the CPU: {size / 1e6:.0f}M parameters at default widths)"
        return
    cpu_failure = row.get("trace")
    _trace(row, cls(config))
    if "traced" in row:
        row["traced_at"] = "default widths, 1 layer, vocabulary and experts shrunk, on the CPU"
    else:
        row["trace"] = f"{row.get('trace')} (on meta: {cpu_failure})"


class _TimeLimitError(Exception):
    pass


@contextlib.contextmanager
def _limit(seconds: int) -> Iterator[None]:
    def _raise(_sig: int, _frame: FrameType | None) -> None:
        raise _TimeLimitError(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _why(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return text[:240]


def _sources(found: dict[str, Any], claimed: dict[str, Any]) -> dict[str, str]:
    """Every packed weight (layer numbers folded to ``*``) and who describes it: ``both``, ``adapter``, ``forward``.

    ``adapter`` alone: the forward did not show it split (``opaque``: it could not follow the weight).
    """
    forward = {n for n, f in found.items() if f.verdict == "packed"}
    adapters = {n for n, lay in claimed.items() if (len(lay.sizes) > 1 or lay.groups > 1) and n in found}  # weights
    out: dict[str, str] = {}
    for name in sorted(forward | adapters):
        who = "both" if name in forward and name in adapters else "forward" if name in forward else "adapter"
        if who == "adapter" and name in found and found[name].verdict == "opaque":
            who = "adapter (forward opaque)"
        out.setdefault(re.sub(r"\.\d+\.", ".*.", name), who)
    return out


def check(model_type: str, class_name: str, seconds: int = 60) -> dict[str, Any]:
    """Build one model tiny and check it; a dict for the JSON-lines file."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    row: dict[str, Any] = {"model_type": model_type, "class": class_name, "built": False, "clean": False}
    start = time.perf_counter()
    try:
        with _limit(seconds), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls = getattr(transformers, class_name)
            config = shrink(CONFIG_MAPPING[model_type]())
            with torch.device("meta"):
                model = cls(config)
            row["built"] = True
            row["params"] = sum(p.numel() for p in model.parameters())
            model.to_empty(device="cpu")
            try:
                packedinit.reset_parameters(model, strict=True)
                row["reset"] = "ok"
            except Exception as e:
                row["reset"] = _why(e)
            try:
                row["audit"] = packedinit.audit(model).answer()
            except Exception as e:
                row["audit"] = "FAILED " + _why(e)
            claimed = packedinit.layouts(model)
            row["claimed"] = len(claimed)
            _trace(row, model)
            if "traced" not in row and not str(row.get("trace", "")).startswith("not run"):
                # the tiny config's shapes may not agree (a sub-config shrunk, its projector not): trace the
                # default widths, one layer, on meta (no values, no compute)
                tiny_failure = row["trace"]
                try:
                    with torch.device("meta"):
                        wide = cls(shallow(CONFIG_MAPPING[model_type]()))
                    _trace(row, wide)
                    if "traced" not in row and _needs_values(str(row.get("trace"))):
                        _trace_on_cpu(row, cls, CONFIG_MAPPING[model_type]())
                except Exception as e:
                    row["trace"] = _why(e)
                if "traced" in row:
                    row.setdefault("traced_at", "default widths, 1 layer, on meta")
                else:
                    row["trace"] = f"{row.get('trace')} (tiny config: {tiny_failure})"[:400]
    except _TimeLimitError as e:
        row["error"] = f"timeout ({e})"
    except Exception as e:
        row["error"] = _why(e)
        row["where"] = traceback.extract_tb(e.__traceback__)[-1].name if e.__traceback__ else ""
    row["seconds"] = round(time.perf_counter() - start, 2)
    row["clean"] = (  # traced, and the adapters and the forward agree
        row["built"]
        and row.get("reset") == "ok"
        and not str(row.get("audit", "FAILED")).startswith("FAILED")
        and "traced" in row
        and not row.get("disagree")
        and "error" not in row
    )
    return row


def _cell(text: object, width: int = 300) -> str:
    return str(text).replace("|", "/").replace("\n", " ")[:width]


def page(rows: Sequence[dict[str, Any]], elapsed: float) -> str:
    """The Markdown page: the totals, then every built model (traced or why not, what is packed and who says so)."""
    import transformers

    built = [r for r in rows if r["built"]]
    clean = [r for r in built if r["clean"]]
    traced = [r for r in built if "traced" in r]
    share = f"{100 * len(traced) / len(built):.1f}%" if built else "-"
    lines = [
        "# The transformers sweep",
        "",
        f"Every base model class of transformers {transformers.__version__} (torch {torch.__version__}), "
        f"built from its default config shrunk to hidden 64, 1 layer, 4 heads, vocab 256, 4 experts, "
        f"and checked: `to_empty` + `packedinit.reset_parameters(strict=True)`, `packedinit.audit`, and the "
        f"forward tracer (`packedinit.infer_layouts`, on the input `packedinit.trace.inputs.example_inputs` "
        f"builds from the config: token ids, pixel values, audio, video, patches, time series) against the "
        f"registered adapters. A model is *clean* only if it was traced and the forward and the adapters agree "
        f"on every weight the forward could follow. Where the tiny config's shapes do not agree, the model is "
        f"traced at its default widths with 1 layer, on meta, or, where its forward reads values (`.item()`, masks), "
        f"built for real on the CPU with vocabulary and experts shrunk (up to {_CPU_PARAMS // 1_000_000}M parameters); "
        f"the *traced* column says which. Regenerate with `PYTHONPATH=. python docs/scripts/sweep.py` "
        f"({elapsed / 60:.0f} min on a shared 2-core machine).",
        "",
        "| tried | built | traced | clean | build failures |",
        "|---|---|---|---|---|",
        f"| {len(rows)} | {len(built)} | {len(traced)} ({share}) | {len(clean)} | {len(rows) - len(built)} |",
        "",
        "## Every built model",
        "",
        "*Packed* lists every weight with more than one block (layer numbers folded to `*`) and where its layout "
        "comes from: `both` (an adapter and the forward agree), `adapter` (the forward did not show a split), "
        "`forward` (no adapter describes it: listed under *disagreements* too).",
        "",
        "| model type | class | traced | packed | disagreements | reset_parameters(strict=True) | clean |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in built:
        why_not = r.get("trace", r.get("error", ""))
        at = f"; {r['traced_at']}" if "traced_at" in r else ""
        how = f"yes ({', '.join(r.get('inputs', []))}{at})" if "traced" in r else f"no: {why_not}"
        packed = "; ".join(f"`{n}` {who}" for n, who in r.get("sources", {}).items()) or "-"
        disagree = "; ".join(r.get("disagree", [])) or "-"
        lines.append(
            f"| {r['model_type']} | {r['class']} | {_cell(how, 200)} | {_cell(packed, 400)} | {_cell(disagree)} "
            f"| {_cell(r.get('reset', r.get('error', '')), 160)} | {'yes' if r['clean'] else 'no'} |"
        )
    lines += ["", "## Not built", "", "| model type | class | reason |", "|---|---|---|"]
    for r in rows:
        if not r["built"]:
            lines.append(f"| {r['model_type']} | {r['class']} | {_cell(r.get('error', ''), 200)} |")
    lines += ["", "## Clean", "", ", ".join(f"`{r['model_type']}`" for r in clean), ""]
    return "\n".join(lines).replace("\\", "/")


def models(only: Sequence[str] | None) -> list[tuple[str, str]]:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    out = []
    for model_type, names in MODEL_MAPPING_NAMES.items():
        name = names[0] if isinstance(names, (tuple, list)) else names
        if only is None or model_type in only:
            out.append((model_type, name))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", default=None, help="model types to run (default: all)")
    parser.add_argument("--jsonl", type=Path, default=Path("docs/bench/sweep.jsonl"))
    parser.add_argument("--page", type=Path, default=Path("docs/pages/sweep.md"))
    parser.add_argument("--seconds", type=int, default=60, help="time limit per model")
    parser.add_argument("--from-jsonl", action="store_true", help="only rewrite the page from --jsonl")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.from_jsonl:
        rows = [json.loads(line) for line in args.jsonl.read_text().splitlines() if line.strip()]
        elapsed = sum(r.get("seconds", 0.0) for r in rows)
    else:
        rows = []
        with args.jsonl.open("w") as out:
            for model_type, name in models(args.only):
                row = check(model_type, name, args.seconds)
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(f"{model_type:32} {'clean' if row['clean'] else 'built' if row['built'] else 'FAIL'}"
                      f" {row['seconds']:6.1f}s", file=sys.stderr, flush=True)  # fmt: skip
        elapsed = time.perf_counter() - start
    args.page.write_text(page(rows, elapsed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
