"""Loading never changes loaded values: ``PYTHONPATH=. python docs/scripts/roundtrip_sweep.py``.

For every model the transformers sweep builds (``docs/scripts/sweep.py``: every base model class,
its default config shrunk), this script:

1. builds the model on the meta device, materialises it (``to_empty``) and fills every parameter
   and every floating-point buffer with deterministic values no init would give (a normal draw
   from a generator seeded by the tensor's name, times 0.5, plus 0.25);
2. saves it with ``save_pretrained`` (safetensors) to a temporary folder;
3. loads it with ``from_pretrained`` inside ``packedinit.fix_torch_defaults()`` and compares
   every entry of the state dict with what was saved, bit for bit (``torch.equal`` on the
   same dtype);
4. loads it first without the fix, from the same seed: a difference there too is transformers'
   own (a tensor its loader recomputes), not packedinit's; a checkpoint transformers cannot reload
   (a shrunk config its validators refuse) is counted apart; the CPU RNG after both loads must
   be the same.

A model is *identical* when every saved entry comes back bit for bit under the fix. Results go
to a JSON-lines file (one line per model) and a short Markdown summary (``--page``). ``--only``
limits the run to some model types (the tests run a fast subset this way).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import packedinit


def _sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sweep", Path(__file__).with_name("sweep.py"))
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sweep = _sweep()


def perturb(model: torch.nn.Module) -> None:
    """Fill every parameter and floating-point buffer with values seeded by its name (deterministic)."""
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and t.numel() > 0:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).mul_(0.5).add_(0.25))


def differing(saved: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    """The saved entries ``model`` does not hold bit for bit (missing ones included)."""
    now = model.state_dict()
    out = []
    for key, value in saved.items():
        got = now.get(key)
        if got is None or got.dtype != value.dtype or got.shape != value.shape or not torch.equal(got, value):
            out.append(key)
    return out


def check(model_type: str, class_name: str, seconds: int = 120) -> dict[str, Any]:
    """Build, perturb, save, load under the fix and compare one model; a dict for the JSON-lines file."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    row: dict[str, Any] = {"model_type": model_type, "class": class_name, "built": False}
    start = time.perf_counter()
    stage = "build"
    try:
        with sweep._limit(seconds), warnings.catch_warnings(), tempfile.TemporaryDirectory() as folder:
            warnings.simplefilter("ignore")
            cls = getattr(transformers, class_name)
            config = sweep.shrink(CONFIG_MAPPING[model_type]())
            with torch.device("meta"):
                model = cls(config)
            row["built"] = True
            stage = "save"
            model.to_empty(device="cpu")
            perturb(model)
            model.save_pretrained(folder)
            saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
            row["saved"] = len(saved)
            del model
            stage = "load without the fix"  # first: a checkpoint transformers cannot reload is not ours
            torch.manual_seed(0)
            plain = cls.from_pretrained(folder)
            rng = torch.get_rng_state()
            without = set(differing(saved, plain))
            del plain
            stage = "load under the fix"
            torch.manual_seed(0)
            with packedinit.fix_torch_defaults():
                loaded = cls.from_pretrained(folder)
            row["same_rng"] = bool(torch.equal(torch.get_rng_state(), rng))
            diff = differing(saved, loaded)
            row["identical"] = not diff
            if diff:
                row["differ"] = diff[:20]
                row["differ_without_fix"] = sorted(without)[:20]
                row["by_fix"] = [k for k in diff if k not in without]
    except sweep._TimeLimitError as e:
        row["error"] = f"timeout ({e})"
        row["stage"] = stage
    except Exception as e:
        row["error"] = sweep._why(e)
        row["stage"] = stage
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def page(rows: Sequence[dict[str, Any]], elapsed: float) -> str:
    """The Markdown summary."""
    import transformers

    built = [r for r in rows if r["built"]]
    loaded = [r for r in built if "identical" in r]
    same = [r for r in loaded if r["identical"]]
    by_fix = [r for r in loaded if r.get("by_fix")]
    theirs = [r for r in loaded if not r["identical"] and not r.get("by_fix")]
    failed = [r for r in built if "identical" not in r]
    ours = [r for r in failed if r.get("stage") == "load under the fix"]
    rng = [r for r in loaded if not r.get("same_rng", True)]
    lines = [
        "# Round trip under the fix",
        "",
        f"Every model the transformers sweep builds (transformers {transformers.__version__}, torch "
        f"{torch.__version__}): perturbed, `save_pretrained`, `from_pretrained` inside "
        f"`packedinit.fix_torch_defaults()`, every saved tensor compared bit for bit. Regenerate with "
        f"`PYTHONPATH=. python docs/scripts/roundtrip_sweep.py` ({elapsed / 60:.0f} min on a shared 2-core machine).",
        "",
        "A model counts as *loaded* when transformers reloads its own checkpoint without the fix; the RNG column "
        "counts models whose CPU RNG after the load under the fix differs from after the load without it.",
        "",
        "| tried | built | loaded | identical | changed by the fix | changed without the fix too "
        "| RNG moved by the fix | save/load failed (without the fix) | load failed only under the fix |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {len(rows)} | {len(built)} | {len(loaded)} | {len(same)} | {len(by_fix)} | {len(theirs)} | {len(rng)} "
        f"| {len(failed) - len(ours)} | {len(ours)} |",
        "",
    ]
    if by_fix:
        lines += ["## Changed by the fix", "", "| model type | tensors |", "|---|---|"]
        lines += [f"| {r['model_type']} | {', '.join(r['by_fix'])[:300]} |" for r in by_fix]
        lines.append("")
    if rng:
        lines += ["## RNG moved by the fix", "", ", ".join(f"`{r['model_type']}`" for r in rng), ""]
    if theirs:
        lines += ["## Changed without the fix too (transformers' loader)", "", "| model type | tensors |", "|---|---|"]
        lines += [f"| {r['model_type']} | {', '.join(r['differ_without_fix'])[:300]} |" for r in theirs]
        lines.append("")
    if failed:
        lines += ["## Built, save or load failed", "", "| model type | stage: reason |", "|---|---|"]
        lines += [f"| {r['model_type']} | {r.get('stage', '')}: {str(r.get('error', ''))[:200]} |" for r in failed]
        lines.append("")
    return "\n".join(lines).replace("\\", "/")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", default=None, help="model types to run (default: all)")
    parser.add_argument("--jsonl", type=Path, default=Path("docs/bench/roundtrip.jsonl"))
    parser.add_argument("--page", type=Path, default=Path("docs/bench/roundtrip.md"))
    parser.add_argument("--seconds", type=int, default=120, help="time limit per model")
    parser.add_argument("--from-jsonl", action="store_true", help="only rewrite the page from --jsonl")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.from_jsonl:
        rows = [json.loads(line) for line in args.jsonl.read_text().splitlines() if line.strip()]
        elapsed = sum(r.get("seconds", 0.0) for r in rows)
    else:
        rows = []
        with args.jsonl.open("w") as out:
            for model_type, name in sweep.models(args.only):
                row = check(model_type, name, args.seconds)
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
                state = "same" if row.get("identical") else "DIFF" if "identical" in row else "fail"
                print(f"{model_type:32} {state} {row['seconds']:6.1f}s", file=sys.stderr, flush=True)
        elapsed = time.perf_counter() - start
    args.page.write_text(page(rows, elapsed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
