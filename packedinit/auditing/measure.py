r"""Read-only audit of a model's packed parameters: is my model affected?

For every packed parameter (see :func:`packedinit.layouts`) and every logical
block of it, the audit measures the block's std, kurtosis and ``max|w|`` and
tests them against common initialisers run on the block alone (*per block*)
and on the whole stored tensor (*packed*): the std within 5 standard errors
(:math:`\sqrt{(\kappa-1)/(4n)}` relative, :math:`\kappa` the kurtosis of the
init's distribution), the kurtosis (1.8 for uniform draws, about 3 for normal
and orthogonal ones), and for uniform inits the exact bound on ``|w|``. A
parameter's verdict pools its blocks. ``packed`` is said only when nothing but
a whole-tensor init fits; where the numbers cannot tell, the verdict is
``undecided``. Inits whose std does not depend on the shape (``normal_(0, 0.02)``,
HF's scaled residual projections, torch's recurrent default) are
``fan-independent``: packing does not change them. The module's own default
(torch's ``LSTM``/``GRU``/``RNN`` cells) and the model config's
``initializer_range`` are added to the references for the parameters they cover.

Parameters that no adapter or annotation describes but that look fused (a
``qkv`` linear layer, ...) are listed as *looks packed*, audited with a guessed
layout, with a ready-to-paste :func:`packedinit.annotate` line (see
:mod:`packedinit.auditing.suspects`). The report ends with a one-line answer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from packedinit.auditing.records import BlockAudit, ParamAudit, Suspect, compact
from packedinit.auditing.report import AuditReport, render
from packedinit.auditing.shards import local_fans
from packedinit.auditing.stats import (
    DEFAULT_REFERENCES,
    TOL_FLOOR,
    ExpectedStd,
    Reference,
    Z,
    tolerance,
)
from packedinit.auditing.suspects import guesses
from packedinit.auditing.tensors import audit_tensors
from packedinit.auditing.verdict import Verdict
from packedinit.errors import PackedInitError
from packedinit.layout import Layout
from packedinit.model.found import Finding, findings

__all__ = [
    "AuditReport",
    "ParamAudit",
    "BlockAudit",
    "ExpectedStd",
    "Reference",
    "Suspect",
    "DEFAULT_REFERENCES",
    "Verdict",
    "Z",
    "TOL_FLOOR",
    "audit",
    "compact",
    "context_references",
    "render",
    "tolerance",
]


def context_references(model: nn.Module, module: nn.Module) -> tuple[Reference, ...]:
    r"""References known from where a parameter lives: its module's default and the model's config.

    * torch's recurrent modules and cells (``RNN``, ``LSTM``, ``GRU``, ``*Cell``):
      ``rnn_default``, ``uniform_(-1/sqrt(H), 1/sqrt(H))`` with ``H = hidden_size``;
    * a model with ``config.initializer_range`` :math:`r` (transformers): ``init_range``,
      ``normal_(0, r)``, and with ``config.num_hidden_layers`` :math:`L`, ``scaled_residual``,
      ``normal_(0, r / sqrt(2 L))`` (GPT-2's ``c_proj``, and others').

    Examples:
        >>> import torch
        >>> [r.describe() for r in context_references(torch.nn.GRU(4, 16), torch.nn.GRU(4, 16))]
        ['uniform_ (a=-0.25, b=0.25)']
    """
    out: list[Reference] = []
    if isinstance(module, (nn.RNNBase, nn.RNNCellBase)) and int(module.hidden_size) > 0:
        k = 1.0 / math.sqrt(int(module.hidden_size))
        out.append(Reference.of("uniform_", name="rnn_default", note="torch's recurrent default", a=-k, b=k))
    config = getattr(model, "config", None)
    r = getattr(config, "initializer_range", None)
    if isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0:
        out.append(Reference.of("normal_", name="init_range", note="config.initializer_range", std=float(r)))
        layers = getattr(config, "num_hidden_layers", None)
        if isinstance(layers, int) and layers > 0:
            out.append(
                Reference.of(
                    "normal_",
                    name="scaled_residual",
                    note="initializer_range / sqrt(2 * n_layer)",
                    std=float(r) / math.sqrt(2 * layers),
                )
            )
    return tuple(out)


def _owner(model: nn.Module, name: str) -> nn.Module:
    path = name.rpartition(".")[0]
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:  # a name a layout gave that is not a module path: no context
        return model


def audit(
    model: nn.Module,
    *,
    layouts: Mapping[str, Layout] | None = None,
    references: Sequence[Reference] = DEFAULT_REFERENCES,
    progress: Callable[[int, int, str], None] | None = None,
    suspects: bool = True,
    example_inputs: tuple[Any, ...] | Mapping[str, Any] | None = None,
) -> AuditReport:
    r"""Audit every packed parameter of ``model``: is its init per block, or packed?

    Read-only: nothing is written, no parameter is copied (each block is read
    through :meth:`Layout.storage_view`; only fp16/bf16 blocks are upcast, one
    block at a time). For every packed parameter and every logical block it
    reports the logical shape, fans, measured mean, std, kurtosis and ``max|w|``,
    and for each reference init (:data:`DEFAULT_REFERENCES`: xavier, kaiming
    fan_in/fan_out with torch's default ``a=0, nonlinearity="leaky_relu"``,
    orthogonal, ``nn.Linear``'s default, ``normal_(0, 0.02)``; plus the module's own
    default and the config's ``initializer_range``, see :func:`context_references`)
    the std it gives the block alone and the whole stored tensor. The verdict says
    which the values fit and which signal decided (see the module docstring).
    Tied parameters are audited once, under their first name, with the others as
    ``aliases``. Meta tensors give shapes and fans only (``std=None``, verdict
    ``"unmeasured"``).

    For ``nn.MultiheadAttention(E, h)`` torch's default runs ``xavier_uniform_``
    on the packed ``(3E, E)`` weight: std :math:`\sqrt{2/4E}` instead of the
    per-block :math:`\sqrt{2/2E}`, so each of q, k, v is :math:`\sqrt 2` too small.

    Args:
        model: the model (any device, meta included).
        layouts: ``{parameter name: Layout}`` to audit instead of
            :func:`packedinit.layouts` ``(model)`` (no "looks packed" guesses then).
        references: the inits to compare with.
        progress: called as ``progress(done, total, name)``, e.g. for a progress bar.
        suspects: look for parameters nobody described that look packed (default ``True``).
        example_inputs: positional (a tuple) or keyword (a mapping) arguments of
            ``model(...)``: the "looks packed" guesses then come from the forward itself
            (:func:`packedinit.infer_layouts`: uneven and per-head splits, stacked experts),
            and a weight the forward uses whole is not guessed. Without them, a model whose
            inputs packedinit can build (a transformers model) is traced on those (once, kept).

    Returns:
        An :class:`AuditReport`; ``report.affected`` names the parameters whose init ran
        on a whole packed tensor, ``report.answer()`` says it in one line.

    Raises:
        PackedInitError: a name in ``layouts`` that is not a parameter of ``model``,
            or a layout that does not fit its parameter.

    Examples:
        >>> import torch
        >>> mha = torch.nn.MultiheadAttention(64, 4)  # torch's default init: packed xavier
        >>> report = audit(mha)
        >>> [(b.label, b.verdict) for b in report["in_proj_weight"].blocks]
        [('q', 'packed'), ('k', 'packed'), ('v', 'packed')]
        >>> report["in_proj_weight"].blocks[0].detail
        'packed: xavier (per-block std would be 1.41x); decided by std'
        >>> from packedinit import chunked_init
        >>> _ = chunked_init(mha.in_proj_weight, 3, 0, torch.nn.init.xavier_uniform_)
        >>> audit(mha)["in_proj_weight"].verdict
        'per-block'
        >>> audit(torch.nn.GRU(64, 128))["weight_ih_l0"].verdict  # torch's own default: not packed
        'fan-independent'
    """
    if not isinstance(model, nn.Module):
        raise PackedInitError(f"audit(model) needs an nn.Module, got {type(model).__name__}.")
    guess = suspects and layouts is None
    if layouts is None:
        from packedinit.model.claims import layouts as _layouts

        layouts = _layouts(model)
    all_named = list(model.named_parameters(remove_duplicate=False))
    first_name: dict[int, str] = {}
    names_of: dict[int, list[str]] = {}
    by_name: dict[str, Tensor] = {}
    for n, p in all_named:
        by_name[n] = p
        first_name.setdefault(id(p), n)
        names_of.setdefault(id(p), []).append(n)
    items: list[tuple[str, Tensor, Layout]] = []
    seen: set[int] = set()
    for name, layout in layouts.items():
        t = by_name.get(name)
        if t is None:
            raise PackedInitError(
                f"layouts names {name!r}, which is not a parameter of {type(model).__name__}; "
                f"parameters: {[n for n, _ in all_named][:12]}{' ...' if len(all_named) > 12 else ''}."
            )
        if id(t) in seen:
            continue
        seen.add(id(t))
        items.append((first_name[id(t)], t, layout))
    order = {n: i for i, n in enumerate(by_name)}
    items.sort(key=lambda it: order[it[0]])
    aliases = {first_name[i]: [n for n in ns if n != first_name[i]] for i, ns in names_of.items() if len(ns) > 1}
    lazy = tuple(n for n, p in all_named if isinstance(p, nn.parameter.UninitializedParameter))
    traced: Mapping[str, Finding] | None = None
    if guess and example_inputs is None:
        traced = findings(model)  # inputs built from the model (a transformers config): traced once, kept
    if guess and example_inputs is not None:
        from packedinit.trace.forward import infer_layouts

        args, kwargs = ((), example_inputs) if isinstance(example_inputs, Mapping) else (example_inputs, {})
        traced = infer_layouts(model, *args, **kwargs)
    found = guesses(model, {*lazy, *(n for i in seen for n in names_of[i])}, traced) if guess else []
    found = [g for g in found if id(g.param) not in seen]
    context: dict[str, tuple[Reference, ...]] = {}
    modules: dict[str, str] = {}
    for name in [it[0] for it in items] + [g.name for g in found]:
        owner = _owner(model, name)
        context[name] = context_references(model, owner)
        modules[name] = type(owner).__name__
    unpacked = len(names_of) - len(items) - len(found) - len(lazy)
    report = audit_tensors(
        items,
        references=references,
        aliases=aliases,
        unpacked=unpacked,
        model=type(model).__name__,
        progress=progress,
        context=context,
        modules=modules,
    )
    shards = local_fans(model, references, layouts)
    if lazy or shards:
        report = dataclasses.replace(report, lazy=lazy, local_fans=shards)
    if not found:
        return report
    guessed = audit_tensors(
        [(g.name, g.param, g.layout) for g in found], references=references, context=context, modules=modules
    )
    sus = tuple(Suspect(g.name, g.why, g.layout, g.annotate, p) for g, p in zip(found, guessed.params, strict=True))
    return AuditReport(
        params=report.params,
        references=report.references,
        unpacked=unpacked,
        model=report.model,
        suspects=sus,
        lazy=lazy,
        local_fans=shards,
    )
