"""Make the figures of the documentation site (committed under docs/pages/img/) and refresh the
command outputs shown on docs/pages/cli.md.

    python docs/scripts/make_figures.py            # writes docs/pages/img/per_block_std.png, updates cli.md
    (packedinit must be importable: `pip install -e .`, or PYTHONPATH=. from the repo root)
    python docs/scripts/make_figures.py --out DIR  # somewhere else

The figure shows, for three packed parameters, the measured std of every logical block
divided by the std the init gives that block on its own ("per-block"): before (the init
run on the whole packed tensor, as torch and most user code do) and after
(``packedinit.chunked_init``, per block). Numbers come from ``packedinit.audit``; the
seed is fixed, so the figure is reproducible.
"""

from __future__ import annotations

import argparse
import io
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from packedinit import Layout, chunked_init
from packedinit.auditing.measure import Reference
from packedinit.auditing.tensors import audit_tensors
from packedinit.cli.command import main as cli_main

PAGES = Path(__file__).resolve().parent.parent / "pages"
OUT = PAGES / "img"
_SHOWN = re.compile(r"```text\n\$ python -m packedinit ([^\n]*)\n(.*?)```", re.DOTALL)
XAVIER = Reference.of("xavier_uniform_", name="xavier", also=("xavier_normal_",))
ORTHO = Reference.of("orthogonal_", name="orthogonal")


@dataclass(frozen=True)
class Case:
    """One panel: a packed parameter, how it is initialised before, and the init's reference."""

    title: str
    labels: tuple[str, ...]
    before: tuple[float, ...]  # measured std / per-block std, init run on the whole tensor
    after: tuple[float, ...]  # the same after chunked_init (per block)
    before_label: str


def _ratios(name: str, w: torch.Tensor, layout: Layout, ref: Reference) -> tuple[float, ...]:
    rep = audit_tensors([(name, w, layout)], references=(ref,))
    out = []
    for b in rep[name].blocks:
        expected = b.expected_std(ref.name).per_block
        assert b.std is not None
        assert expected is not None
        out.append(b.std / expected)
    return tuple(out)


def figure_data(seed: int = 0) -> list[Case]:
    """The numbers behind the figure: MHA (torch default), LSTM (xavier / orthogonal), GQA (xavier)."""
    torch.manual_seed(seed)
    cases: list[Case] = []

    e = 256
    mha = nn.MultiheadAttention(e, 8)  # torch's default: xavier_uniform_ on the packed (3E, E) weight
    lay = Layout(0, [e] * 3, names=("q", "k", "v"))
    w = mha.in_proj_weight.detach()
    before = _ratios("in_proj_weight", w, lay, XAVIER)
    chunked_init(w, lay, None, torch.nn.init.xavier_uniform_)
    cases.append(
        Case(
            "MultiheadAttention(256, 8)\nin_proj_weight (768, 256)",
            ("q", "k", "v"),
            before,
            _ratios("in_proj_weight", w, lay, XAVIER),
            "torch default (xavier on packed)",
        )
    )

    h, i = 256, 128
    gates = ("i", "f", "g", "o")
    lay = Layout(0, [h] * 4, names=gates)
    w_ih, w_hh = torch.empty(4 * h, i), torch.empty(4 * h, h)
    torch.nn.init.xavier_uniform_(w_ih)
    torch.nn.init.orthogonal_(w_hh)
    before_ih = _ratios("weight_ih_l0", w_ih, lay, XAVIER)
    before_hh = _ratios("weight_hh_l0", w_hh, lay, ORTHO)
    chunked_init(w_ih, lay, None, torch.nn.init.xavier_uniform_)
    chunked_init(w_hh, lay, None, torch.nn.init.orthogonal_)
    cases.append(
        Case(
            "LSTM(128, 256) weight_ih_l0 (1024, 128)\nxavier_uniform_",
            gates,
            before_ih,
            _ratios("weight_ih_l0", w_ih, lay, XAVIER),
            "xavier_uniform_ on packed",
        )
    )
    cases.append(
        Case(
            "LSTM(128, 256) weight_hh_l0 (1024, 256)\northogonal_",
            gates,
            before_hh,
            _ratios("weight_hh_l0", w_hh, lay, ORTHO),
            "orthogonal_ on packed",
        )
    )

    nh, nkv, d = 8, 2, 32
    lay = Layout(0, [nh * d, nkv * d, nkv * d], names=("q", "k", "v"))
    w = torch.empty(nh * d + 2 * nkv * d, nh * d)
    torch.nn.init.xavier_uniform_(w)
    before = _ratios("qkv_proj", w, lay, XAVIER)
    chunked_init(w, lay, None, torch.nn.init.xavier_uniform_)
    cases.append(
        Case(
            "GQA qkv_proj (384, 256)\n8 q heads, 2 kv heads, d=32",
            ("q", "k", "v"),
            before,
            _ratios("qkv_proj", w, lay, XAVIER),
            "xavier_uniform_ on packed",
        )
    )
    return cases


def make_figure(out_dir: Path, seed: int = 0) -> Path:
    """Draw the figure into ``out_dir/per_block_std.png`` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = figure_data(seed)
    fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 3.6), sharey=True)
    for ax, case in zip(axes, cases, strict=True):
        x = range(len(case.labels))
        width = 0.38
        ax.bar(
            [k - width / 2 for k in x], case.before, width, color="#d62728", label="before: init on the packed tensor"
        )
        ax.bar([k + width / 2 for k in x], case.after, width, color="#2ca02c", label="after: packedinit, per block")
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(list(x), case.labels)
        ax.set_title(case.title, fontsize=8.5)
        for k, r in enumerate(case.before):
            ax.text(k - width / 2, r + 0.02, f"{r:.2f}", ha="center", fontsize=7)
    axes[0].set_ylabel("block std / per-block std")
    axes[0].set_ylim(0, 1.25)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "per_block_std.png"
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def refresh_cli_page(page: Path = PAGES / "cli.md") -> bool:
    """Re-run every ``$ python -m packedinit ...`` shown in ``page`` and put in its current output.

    Blocks with a second ``$`` line (an error and its exit code) are left alone. Returns whether
    the page changed.
    """
    text = page.read_text()

    def rerun(m: re.Match[str]) -> str:
        if "\n$ " in m.group(2):
            return m.group(0)
        out, err = io.StringIO(), io.StringIO()
        cli_main(m.group(1).split(), stdout=out, stderr=err)
        return f"```text\n$ python -m packedinit {m.group(1)}\n{out.getvalue()}```"

    new = _SHOWN.sub(rerun, text)
    if new != text:
        page.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--out DIR`` (default docs/pages/img), ``--seed N``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    path = make_figure(ns.out, ns.seed)
    for case in figure_data(ns.seed):
        title = case.title.replace("\n", " ")
        print(f"{title}: before {[round(r, 3) for r in case.before]} after {[round(r, 3) for r in case.after]}")
    print(f"wrote {path}")
    print("cli.md updated" if refresh_cli_page() else "cli.md already current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
