"""Calibrate the audit's verdicts: false "packed" on torch's defaults, detection of whole-tensor inits.

    PYTHONPATH=. python docs/scripts/audit_calibration.py              # the table on docs/pages/audit.md
    PYTHONPATH=. python docs/scripts/audit_calibration.py --seeds 5    # a quick look

(a) False "packed": torch's own default init of GRU, LSTM, RNN and their cells, MultiheadAttention,
Linear and Conv, at small and large sizes, one fresh module per seed. Each weight of 2 dims or more
is audited: with the registry's layout where it has one (GRU/LSTM gates, MHA's in_proj), otherwise
with a layout as if it were a fused projection (3 equal blocks along dim 0, or as many as the
hidden size allows); and GRU/LSTM and their cells of random sizes 1..40 (a trial is a module).
MHA's ``in_proj_weight`` is the one torch default that *is* a packed init (xavier_uniform_ on the
(3E, E) tensor, pytorch/pytorch#166378): it counts as a detection, not a trial here. A trial is
false when the verdict is ``packed`` or ``mixed``.

(b) Detection: ``xavier_uniform_``, ``xavier_normal_``, ``orthogonal_``, ``kaiming_uniform_`` and
``kaiming_normal_`` with ``mode="fan_out"`` run on the whole packed tensor, for common layouts
(MHA / LSTM / GQA / NeoX-interleaved / GPT-2 Conv1D transposed / MoE experts) with blocks of at
least 4096 values, and on tiny layouts (blocks of 32 to 64 values) where the numbers may not decide.
Detected = verdict ``packed``. Per-block init of the same tensors (``chunked_init``) must never read
``packed``: that is a false positive too, and counted in (a).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from packedinit import Layout, chunked_init
from packedinit.auditing.measure import Reference, audit
from packedinit.auditing.tensors import audit_tensors

init = nn.init


@dataclass(frozen=True)
class Rate:
    """One row: how many trials, how many read ``packed``, how many ``undecided``."""

    what: str
    size: str
    trials: int
    packed: int
    undecided: int
    note: str = ""

    @property
    def rate(self) -> float:
        """The fraction read ``packed``."""
        return self.packed / self.trials if self.trials else 0.0


def _hypothetical(p: Tensor) -> Layout:
    k = 3 if p.shape[0] % 3 == 0 else (4 if p.shape[0] % 4 == 0 else 2)
    return Layout(0, [p.shape[0] // k] * k)


DEFAULTS: dict[str, dict[str, Callable[[], nn.Module]]] = {
    "GRU": {"small": lambda: nn.GRU(4, 8), "large": lambda: nn.GRU(64, 128)},
    "LSTM": {"small": lambda: nn.LSTM(4, 8), "large": lambda: nn.LSTM(128, 256)},
    "RNN": {"small": lambda: nn.RNN(4, 9), "large": lambda: nn.RNN(64, 192)},
    "GRUCell": {"small": lambda: nn.GRUCell(4, 8), "large": lambda: nn.GRUCell(64, 128)},
    "LSTMCell": {"small": lambda: nn.LSTMCell(4, 8), "large": lambda: nn.LSTMCell(64, 128)},
    "RNNCell": {"small": lambda: nn.RNNCell(4, 9), "large": lambda: nn.RNNCell(64, 192)},
    "MultiheadAttention": {
        "small": lambda: nn.MultiheadAttention(8, 2),
        "large": lambda: nn.MultiheadAttention(128, 4),
    },
    "Linear": {"small": lambda: nn.Linear(8, 24), "large": lambda: nn.Linear(256, 768)},
    "Conv2d": {"small": lambda: nn.Conv2d(4, 12, 3), "large": lambda: nn.Conv2d(32, 96, 3)},
}


def false_packed(seeds: int) -> list[Rate]:
    """(a): for every module and size, the number of weights whose verdict is ``packed``/``mixed``."""
    rows = []
    for what, sizes in DEFAULTS.items():
        for size, make in sizes.items():
            trials = packed = undecided = 0
            for seed in range(seeds):
                torch.manual_seed(seed)
                m = make()
                lay = {}
                rep0 = audit(m)
                known = {p.name: p.layout for p in rep0.params}
                for name, p in m.named_parameters():
                    if p.dim() >= 2 and not (what == "MultiheadAttention" and name == "in_proj_weight"):
                        lay[name] = known.get(name, _hypothetical(p))
                rep = audit(m, layouts=lay)
                for p in rep.params:
                    trials += 1
                    packed += p.affected
                    undecided += p.verdict == "undecided"
            rows.append(Rate(what, size, trials, packed, undecided, "torch default"))
    return rows


def random_sizes(trials: int) -> list[Rate]:
    """(a''): GRU / LSTM / GRUCell / LSTMCell with random sizes 1..40, torch's default: modules read ``packed``."""
    import random

    rng = random.Random(0)
    kinds: list[type[nn.Module]] = [nn.GRU, nn.LSTM, nn.GRUCell, nn.LSTMCell]
    packed = undecided = 0
    for t in range(trials):
        kind = rng.choice(kinds)
        torch.manual_seed(t)
        rep = audit(kind(rng.randint(1, 40), rng.randint(1, 40)))
        packed += bool(rep.affected)
        undecided += bool(rep.undecided)
    return [Rate("GRU/LSTM/cells", "random 1..40", trials, packed, undecided, "modules, torch default")]


LAYOUTS: dict[str, tuple[tuple[int, ...], Layout]] = {
    "MHA (3E, E), E=64": ((192, 64), Layout(0, [64] * 3)),
    "LSTM (4H, I), H=I=64": ((256, 64), Layout(0, [64] * 4)),
    "GQA [q|k|v] = [128|32|32] x 128": ((192, 128), Layout(0, [128, 32, 32])),
    "NeoX 4 heads x [16|16|16], in 64": ((192, 64), Layout(0, [16] * 3, groups=4)),
    "NeoX 4 heads x [16|16|16], in 256": ((192, 256), Layout(0, [16] * 3, groups=4)),
    "GPT-2 Conv1D (E, 3E), E=64": ((64, 192), Layout(1, [64] * 3, transposed=True)),
    "experts (4, 2I, E), I=E=64": ((4, 128, 64), Layout(1, [64, 64], batch_dims=1)),
    "tiny MHA (3E, E), E=8": ((24, 8), Layout(0, [8] * 3)),
    "tiny LSTM (4H, I), H=8, I=4": ((32, 4), Layout(0, [8] * 4)),
}
WHOLE: dict[str, tuple[Callable[[Tensor], Tensor], Reference]] = {
    "xavier_uniform_": (init.xavier_uniform_, Reference.of("xavier_uniform_")),
    "xavier_normal_": (init.xavier_normal_, Reference.of("xavier_normal_")),
    "orthogonal_": (init.orthogonal_, Reference.of("orthogonal_")),
    "kaiming_uniform_(mode='fan_out')": (
        lambda t: init.kaiming_uniform_(t, mode="fan_out"),
        Reference.of("kaiming_uniform_", mode="fan_out"),
    ),
    "kaiming_normal_(mode='fan_out')": (
        lambda t: init.kaiming_normal_(t, mode="fan_out"),
        Reference.of("kaiming_normal_", mode="fan_out"),
    ),
}


def changes(ref: Reference, shape: tuple[int, ...], lay: Layout) -> bool:
    """Does packing change the std this init gives the blocks? (If not, nothing is affected to detect.)"""
    whole = ref.std(shape)
    return any(abs((ref.std(b.shape) or 0.0) - (whole or 0.0)) > 1e-12 for b in lay.blocks(shape))


def smallest_block(shape: tuple[int, ...], lay: Layout) -> int:
    """The number of values in the layout's smallest block."""
    return min(b.numel for b in lay.blocks(shape))


def detection(seeds: int, *, per_block: bool = False, layouts: list[str] | None = None) -> list[Rate]:
    """(b): for every init and layout, the number of whole-tensor inits read ``packed``.

    With ``per_block=True`` the same inits run per block (``chunked_init``): every ``packed`` is false.
    ``layouts`` picks some of :data:`LAYOUTS` by name (default: all).
    """
    rows = []
    for fn_name, (fn, ref) in WHOLE.items():
        for lay_name, (shape, lay) in LAYOUTS.items():
            if layouts is not None and lay_name not in layouts:
                continue
            note = f"blocks >= {smallest_block(shape, lay)}"
            if not changes(ref, shape, lay):
                note = "packing does not change it: nothing to detect"
            trials = packed = undecided = 0
            for seed in range(seeds):
                torch.manual_seed(seed)
                w = torch.empty(shape)
                if per_block:
                    chunked_init(w, lay, None, fn)
                else:
                    fn(w)
                p = audit_tensors([("w", w, lay)])["w"]
                trials += 1
                packed += p.affected
                undecided += p.verdict == "undecided"
            rows.append(Rate(fn_name, lay_name, trials, packed, undecided, note))
    return rows


def table(rows: list[Rate], head: tuple[str, str]) -> str:
    """A markdown table of ``rows``."""
    lines = [
        f"| {head[0]} | {head[1]} | trials | packed | undecided | packed rate | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r.what} | {r.size.replace('|', '/')} | {r.trials} | {r.packed} | {r.undecided} | {r.rate:.1%} | {r.note} |"
        for r in rows
    ]
    total = sum(r.trials for r in rows)
    hits = sum(r.packed for r in rows)
    und = sum(r.undecided for r in rows)
    lines.append(f"| **all** | | **{total}** | **{hits}** | {und} | {hits / total:.1%} | |")
    return "\n".join(lines)


def targets(fp_rows: list[Rate], per_block_rows: list[Rate], det_rows: list[Rate]) -> dict[str, float]:
    """The numbers the targets are about: false packed count and trials; detection on blocks >= 4096."""
    target = [r for r in det_rows if r.note.startswith("blocks >= ") and int(r.note.split()[-1]) >= 4096]
    return {
        "false_trials": sum(r.trials for r in (*fp_rows, *per_block_rows)),
        "false_packed": sum(r.packed for r in (*fp_rows, *per_block_rows)),
        "detect_trials": sum(r.trials for r in target),
        "detected": sum(r.packed for r in target),
        "detection_rate": sum(r.packed for r in target) / max(1, sum(r.trials for r in target)),
    }


def main(argv: list[str] | None = None) -> None:
    """Print the tables of docs/pages/audit.md."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=60, help="seeds per row (default 60)")
    ap.add_argument("--random", type=int, default=3000, help="recurrent modules of random size (default 3000)")
    ns = ap.parse_args(argv)
    fp, pb, det = false_packed(ns.seeds), detection(ns.seeds, per_block=True), detection(ns.seeds)
    fp += random_sizes(ns.random)
    print(f"(a) torch's defaults, {ns.seeds} seeds: a 'packed' here is a false alarm\n")
    print(table(fp, ("module", "size")))
    print(f"\n(a') per-block init (chunked_init), {ns.seeds} seeds: a 'packed' here is a false alarm\n")
    print(table(pb, ("init", "layout")))
    print(f"\n(b) whole-tensor init on packed tensors, {ns.seeds} seeds: detection = 'packed'\n")
    print(table(det, ("init", "layout")))
    t = targets(fp, pb, det)
    print(
        f"\nfalse 'packed': {t['false_packed']:.0f} in {t['false_trials']:.0f} trials; "
        f"detection with blocks >= 4096 (where packing changes the std): "
        f"{t['detected']:.0f} / {t['detect_trials']:.0f} = {t['detection_rate']:.2%}"
    )


if __name__ == "__main__":
    main()
