"""Every transformers base model, built tiny and checked: ``PYTHONPATH=. python docs/scripts/sweep.py``.

For every ``(model_type, class)`` in ``transformers.models.auto.modeling_auto.MODEL_MAPPING_NAMES``
the model's default config is shrunk (hidden 64, 1 layer, 4 heads, vocab 256, 4 experts;
nested sub-configs too) and the model is built on the meta device. A build that fails is
counted with its reason. A built model is then checked:

1. ``to_empty(device="cpu")`` then ``packedinit.reset_parameters(model, strict=True)``: passes,
   or its message is recorded (what the model's own init leaves unset);
2. ``packedinit.audit(model)`` runs and gives its one-line answer;
3. for models whose main input is ``input_ids``: ``packedinit.infer_layouts`` on a (2, 5) token
   batch, compared with ``packedinit.layouts(model)`` (every weight where they disagree is listed).

A model is *clean* when all three pass with no disagreement. Results go to a JSON-lines file
(one line per model, so a run cut short keeps what it did) and a Markdown page
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

_SIZES: dict[str, int] = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 64, "n_embed": 64, "d_embed": 64,
    "num_hidden_layers": 1, "num_layers": 1, "n_layer": 1, "n_layers": 1, "encoder_layers": 1,
    "decoder_layers": 1, "num_encoder_layers": 1, "num_decoder_layers": 1, "depth": 1,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "ffn_dim": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "n_inner": 128,
    "d_ff": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "vocab_size": 256, "max_position_embeddings": 64, "n_positions": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "top_k": 2, "moe_topk": 2,
}  # fmt: skip


def shrink(config: Any, depth: int = 0) -> Any:
    """Shrink a config in place (and its sub-configs): the sizes above where the config has them."""
    from transformers import PretrainedConfig

    for key, value in _SIZES.items():
        old = getattr(config, key, None)
        if isinstance(old, int) and not isinstance(old, bool) and old > value:
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, value)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if (
        isinstance(getattr(config, "head_dim", None), int)
        and isinstance(heads, int)
        and isinstance(hidden, int)
        and not hasattr(config, "qk_rope_head_dim")  # MLA: head_dim is the rotary size, kept
    ):
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.head_dim = max(hidden // heads, 8)
    ssm_heads, expand = getattr(config, "num_heads", None), getattr(config, "expand", None)
    mamba2 = isinstance(ssm_heads, int) and isinstance(expand, int) and isinstance(hidden, int)
    if mamba2 and hasattr(config, "head_dim"):
        with contextlib.suppress(AttributeError, TypeError, ValueError):  # Mamba-2: heads * head_dim = expand * hidden
            config.head_dim = expand * hidden // ssm_heads
    for key, value in (("n_group", 1), ("topk_group", 1), ("n_groups", 1), ("num_key_value_heads", 2)):
        old = getattr(config, key, None)  # routing groups, SSM groups: must divide what was shrunk
        if isinstance(old, int) and not isinstance(old, bool) and old > value:
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, value)
    if hasattr(config, "kv_lora_rank") and isinstance(heads, int) and hasattr(config, "num_key_value_heads"):
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.num_key_value_heads = heads  # MLA: every head has its own k and v
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= 256:
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, 0)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) > 1:
        kept = list(dict.fromkeys(layer_types))[:2]
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.layer_types = kept
            for key in ("num_hidden_layers", "num_layers"):
                if hasattr(config, key):
                    setattr(config, key, len(kept))
    if depth < 3:
        for value in list(vars(config).values()):
            if isinstance(value, PretrainedConfig):
                shrink(value, depth + 1)
    return config


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
            if getattr(model, "main_input_name", None) == "input_ids":
                model.eval()
                ids = torch.randint(1, 200, (2, 5), generator=torch.Generator().manual_seed(0))
                extra = {"decoder_input_ids": ids} if getattr(config, "is_encoder_decoder", False) else {}
                try:
                    found = packedinit.infer_layouts(model, input_ids=ids, **extra)
                    row["traced"] = len(found)
                    row["packed_by_forward"] = sum(1 for f in found.values() if f.verdict == "packed")
                    row["opaque"] = sum(1 for f in found.values() if f.verdict == "opaque")
                    row["disagree"] = [f"{n}: {why}" for n, why in disagreements(found, claimed)]
                except Exception as e:
                    row["trace"] = _why(e.__cause__ or e)
            else:
                row["trace"] = f"not run: main input is {getattr(model, 'main_input_name', None)!r}"
    except _TimeLimitError as e:
        row["error"] = f"timeout ({e})"
    except Exception as e:
        row["error"] = _why(e)
        row["where"] = traceback.extract_tb(e.__traceback__)[-1].name if e.__traceback__ else ""
    row["seconds"] = round(time.perf_counter() - start, 2)
    row["clean"] = (
        row["built"]
        and row.get("reset") == "ok"
        and not str(row.get("audit", "FAILED")).startswith("FAILED")
        and not row.get("disagree")
        and not str(row.get("trace", "not run")).startswith(("PackedInitError", "RuntimeError", "TypeError", "Value"))
        and "error" not in row
    )
    return row


def _short(text: object, limit: int) -> str:
    """``text`` cut at a word boundary to about ``limit`` characters (long cells would push the table wide)."""
    text = " ".join(str(text).split()).replace("|", "/")
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0]
    return cut.rstrip(",;:") + " ..."


def _traced(r: dict[str, Any]) -> str:
    if "traced" in r:
        return f"yes, {r['traced']} weights"
    trace = str(r.get("trace", r.get("error", "")))
    if trace.startswith("not run: main input is "):
        return f"no (input {trace.rsplit(' ', 1)[-1]})"
    return "failed"


def _packed(r: dict[str, Any]) -> str:
    """Packed weights found, and where their layout came from (the adapters, the forward)."""
    only_forward = [d.split(":", 1)[0] for d in r.get("disagree", []) if "no adapter or annotation" in d]
    parts = []
    if r.get("claimed"):
        agree = ", the forward agrees" if r.get("packed_by_forward") and not r.get("disagree") else ""
        parts.append(f"{r['claimed']} from adapters{agree}")
    if only_forward:
        names = ", ".join(f"`{n}`" for n in only_forward[:2]) + (
            f" +{len(only_forward) - 2}" if len(only_forward) > 2 else ""
        )
        parts.append(f"{len(only_forward)} only from the forward (no adapter): {names}")
    other = [d for d in r.get("disagree", []) if "no adapter or annotation" not in d]
    if other:
        parts.append(f"{len(other)} where adapters and forward disagree: {_short(other[0], 80)}")
    return "; ".join(parts) or "none"


def _why_not_clean(r: dict[str, Any]) -> str:
    why = []
    if r.get("reset", "ok") != "ok":
        message = re.sub(r"^\w+: reset_parameters\([^)]*\): ", "", str(r["reset"]))
        why.append("reset_parameters: " + _short(message, 110))
    if str(r.get("audit", "")).startswith("FAILED"):
        why.append("audit: " + _short(r["audit"], 80))
    if r.get("disagree"):
        why.append("the forward shows packing no adapter describes" if _packed(r).count("only from") else "disagree")
    trace = str(r.get("trace", ""))
    if "traced" not in r and trace.startswith(("PackedInitError", "RuntimeError", "TypeError", "Value")):
        why.append("the forward, given only `input_ids`, failed: " + _short(trace, 70))
    if "error" in r:
        why.append(_short(r["error"], 110))
    return "; ".join(why)


def page(rows: Sequence[dict[str, Any]], elapsed: float) -> str:
    """The Markdown page."""
    import transformers

    built = [r for r in rows if r["built"]]
    clean = [r for r in built if r["clean"]]
    traced = [r for r in built if "traced" in r]
    lines = [
        "# The transformers sweep",
        "",
        f"Every base model class of transformers {transformers.__version__} (torch {torch.__version__}), "
        f"built from its default config shrunk to hidden 64, 1 layer, 4 heads, vocab 256, 4 experts, "
        f"and checked: `to_empty` + `packedinit.reset_parameters(strict=True)`, `packedinit.audit`, and for "
        f"token models the forward tracer (`packedinit.infer_layouts`) against the registered adapters. "
        f"Regenerate with `PYTHONPATH=. python docs/scripts/sweep.py` ({elapsed / 60:.0f} min on a shared "
        f"2-core machine).",
        "",
        "| tried | built | clean | traced | build failures |",
        "|---|---|---|---|---|",
        f"| {len(rows)} | {len(built)} | {len(clean)} | {len(traced)} | {len(rows) - len(built)} |",
        "",
        "## Built, not clean",
        "",
        "Per model: whether its forward was traced (token models only: the tracer feeds `input_ids`), the "
        "packed weights found and where their layout came from (the registered adapters, or only the "
        "forward), and why the model is not clean. Each model's class and the full messages are in "
        "`docs/bench/sweep.jsonl`.",
        "",
        '<div class="sweep-table" markdown>',
        "",
        "| model | traced | packed weights: layout from | why not clean |",
        "|---|---|---|---|",
    ]
    for r in built:
        if r["clean"]:
            continue
        lines.append(f"| {r['model_type']} | {_traced(r)} | {_packed(r)} | {_why_not_clean(r)} |")
    lines += [
        "",
        "</div>",
        "",
        "## Clean",
        "",
        "Built, `reset_parameters(strict=True)` and `audit` pass, and where the forward was traced it agrees "
        "with the adapters.",
        "",
        '<div class="sweep-table" markdown>',
        "",
        "| model | traced | packed weights: layout from |",
        "|---|---|---|",
    ]
    lines += [f"| {r['model_type']} | {_traced(r)} | {_packed(r)} |" for r in clean]
    lines += ["", "</div>"]
    lines += [
        "",
        "## Not built",
        "",
        '<div class="sweep-table" markdown>',
        "",
        "| model type | class | reason |",
        "|---|---|---|",
    ]
    for r in rows:
        if not r["built"]:
            lines.append(f"| {r['model_type']} | {r['class']} | {_short(r.get('error', ''), 160)} |")
    lines += ["", "</div>", ""]
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
