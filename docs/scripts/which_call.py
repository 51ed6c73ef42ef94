"""The numbers of the "Which call do I use" table (README and docs index): what each call changes.

One real model, a 2-layer ``nn.TransformerEncoder`` (d_model 32, 4 heads, feed-forward 64: 24
parameter tensors), built from seed 0. Each re-initialising call draws from seed 1 (from seed 0 it would redraw some
of torch's own numbers and look as if it changed less). For each call, the count of parameter tensors whose values
differ from the model as torch built it. tests/test_which_call.py runs :func:`measure` and checks
the tables against it. Run ``python docs/scripts/which_call.py`` to print the rows.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.init import xavier_uniform_

import packedinit


def build() -> nn.TransformerEncoder:
    """The model, from seed 0 (construction draws from the global RNG)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _changed(before: nn.Module, after: nn.Module) -> list[str]:
    old = dict(before.named_parameters())
    return [n for n, p in after.named_parameters() if not torch.equal(p, old[n])]


def measure() -> dict[str, list[str]]:
    """Per call, the names of the parameters it changes on :func:`build`'s model."""
    out: dict[str, list[str]] = {}
    torch_built = build()

    model = build()
    fix = packedinit.audit(model).fix()
    assert fix is not None
    exec(fix, {"packedinit": packedinit, "torch": torch, "model": model})  # the audit's printed call, verbatim
    out["audit fix"] = _changed(torch_built, model)

    handle = packedinit.fix_torch_defaults()
    try:
        model = build()
    finally:
        handle.undo()
    out["fix_torch_defaults"] = _changed(torch_built, model)

    model = build()
    packedinit.reset_parameters(model, generator=torch.Generator().manual_seed(1))
    out["reset_parameters"] = _changed(torch_built, model)

    model = build()
    packedinit.chunked(xavier_uniform_)(model, generator=torch.Generator().manual_seed(1))
    out["chunked(f)(model)"] = _changed(torch_built, model)

    model = build()
    packedinit.init_model(model, xavier_uniform_, generator=torch.Generator().manual_seed(1))
    out["init_model(model, f)"] = _changed(torch_built, model)
    return out


def total() -> int:
    """The model's number of parameter tensors."""
    return len(list(build().parameters()))


if __name__ == "__main__":
    n = total()
    for call, names in measure().items():
        print(f"{call}: {len(names)} of {n}: {', '.join(names)}")
