"""Per-parameter comparison of a meta-built, materialised model with a normal (eager) build.

The done criterion of the model-init work: after meta -> ``to_empty`` -> ``reset_parameters``
every parameter's std is within 15% of the same parameter of an eager build (the library's own
init included). Constant tensors (ones, zeros) must match exactly; tensors too small for a std
to mean anything (under ``MIN_NUMEL`` elements) are compared only for being finite.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import packedinit

MIN_NUMEL = 256
REL = 0.15


def mismatches(eager: nn.Module, meta_built: nn.Module, rel: float = REL) -> list[str]:
    """The parameters whose std (or constant value) differs: ``"name: eager 0.02 meta 0.10"``."""
    out: list[str] = []
    theirs = dict(meta_built.named_parameters())
    for name, p in eager.named_parameters():
        q = theirs[name].detach().float()
        ref = p.detach().float()
        if not bool(torch.isfinite(q).all()):
            out.append(f"{name}: not finite")
            continue
        if ref.numel() > 1 and float(ref.std()) < 1e-12:  # a constant: ones, zeros, a fill value
            if ref.numel() > 1 and not torch.equal(ref, q):
                out.append(f"{name}: constant {float(ref.flatten()[0]):.4g}, meta gives std {float(q.std()):.4g}")
            continue
        if ref.numel() < MIN_NUMEL:
            continue
        a, b = float(ref.std()), float(q.std())
        if abs(b - a) > rel * a:
            out.append(f"{name} {tuple(ref.shape)}: eager std {a:.4g}, meta flow {b:.4g}")
    return out


def stds(model: nn.Module, names: list[str]) -> dict[str, float]:
    params = dict(model.named_parameters())
    return {n: round(float(params[n].detach().float().std()), 4) for n in names}


def eager_and_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """A normal build (under ``fix_torch_defaults()``: packed weights per block, as packedinit gives them,
    bit-identical to torch elsewhere), and the same built on meta and moved to CPU (uninitialised memory)."""
    torch.manual_seed(0)
    with packedinit.fix_torch_defaults():
        eager = build()
    with torch.device("meta"):
        meta_built = build()
    meta_built.to_empty(device="cpu")
    return eager, meta_built
