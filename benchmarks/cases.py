"""Benchmark cases: the packed tensors (and whole models) whose init cost is measured.

A :class:`Case` is a pure description (shapes and layouts, or a model factory). Nothing
is allocated until :func:`materialize` is called with a dtype and a device.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from packedinit import Layout
from packedinit.layout import LogicalBlock

__all__ = [
    "Case",
    "Kind",
    "Idiom",
    "TensorSpec",
    "Materialized",
    "build_cases",
    "select_cases",
    "layout_kind",
    "materialize",
    "naive_views",
]

#: contiguous: every block is a contiguous view (fast path); scratch: some block is not a
#: view or not contiguous (dim-1 splits, transposed, interleaved); overhead: many tiny
#: tensors (per-call cost); model: a whole nn.Module.
Kind = Literal["contiguous", "scratch", "overhead", "model"]
#: How a model case is initialised: ``chunked(f)(model)``, ``model.apply(chunked(f))`` or ``init_model(model, f)``;
#: ``traced``: ``chunked(f)(model)`` with what packedinit kept of the model's forward dropped before every call,
#: so each call pays for the trace, as the first call on a new architecture does (issue 26).
Idiom = Literal["chunked", "apply", "init_model", "traced"]


@dataclass(frozen=True)
class TensorSpec:
    """One packed parameter: its name, stored shape and Layout (``None``: one block)."""

    name: str
    shape: tuple[int, ...]
    layout: Layout | None

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Case:
    """A benchmark case.

    Attributes:
        name: unique id, e.g. ``"mha_in_proj_E1024"``.
        family: the kind of real layer it stands for (``"mha"``, ``"lstm"``, ...).
        description: one line for the report.
        tensors: the parameters of a tensor case (empty for a model case).
        copies: how many separate copies of ``tensors`` (10k small tensors: 10_000).
        scale: the model width (E or H) the targets refer to.
        model: a factory of the whole model for a model case.
        model_params: parameter count of the model (for the report; 0 when unknown).
    """

    name: str
    family: str
    description: str
    tensors: tuple[TensorSpec, ...] = ()
    copies: int = 1
    scale: int = 0
    model: Callable[[], nn.Module] | None = field(default=None, compare=False)
    model_params: int = 0
    idiom: Idiom = "chunked"

    @property
    def is_model(self) -> bool:
        """Whether this is a whole-model case."""
        return self.model is not None

    @property
    def numel(self) -> int:
        """Elements written by one init of the case (>= 2-D parameters of a model)."""
        if self.is_model:
            return self.model_params
        return self.copies * sum(t.numel for t in self.tensors)

    @property
    def max_tensor_numel(self) -> int:
        """The largest single tensor's number of elements."""
        return max((t.numel for t in self.tensors), default=self.model_params)

    @property
    def kind(self) -> Kind:
        """Which target family the case belongs to (see :data:`Kind`)."""
        if self.is_model:
            return "model"
        if self.copies > 1 and self.max_tensor_numel < 65536:
            return "overhead"
        kinds = {layout_kind(t.shape, t.layout) for t in self.tensors}
        return "scratch" if "scratch" in kinds else "contiguous"


def layout_kind(shape: Sequence[int], layout: Layout | None) -> Literal["contiguous", "scratch"]:
    """``"contiguous"`` when every block of ``layout`` is a contiguous view of the storage.

    Decided on a meta tensor: nothing is allocated.
    """
    if layout is None:
        return "contiguous"
    meta = torch.empty(tuple(shape), device="meta")
    for block in layout.blocks(tuple(shape)):
        view = layout.logical_view(meta, block)
        if view is None or not view.is_contiguous():
            return "scratch"
    return "contiguous"


def naive_views(tensor: Tensor, layout: Layout | None) -> list[Tensor]:
    """The views a hand-written per-view loop inits, one call each.

    A block that is a (possibly strided) view of logical shape is used as is: torch's
    init functions write non-contiguous views in place. An interleaved block has no such
    view; a hand-written loop then walks it group by group (per head), which is what
    this returns (more calls; their fans are the slice's, not the block's).
    """
    if layout is None:
        return [tensor]
    views: list[Tensor] = []
    for block in layout.blocks(tuple(tensor.shape)):
        lv = layout.logical_view(tensor, block)
        if lv is not None:
            views.append(lv)
            continue
        sv = layout.storage_view(tensor, block)
        d = layout.normalized_dim(tensor.dim()) - layout.batch_dims
        for g in range(layout.groups):
            v = sv.select(d, g)
            views.append(v.transpose(0, 1) if layout.transposed else v)
    return views


def first_block(spec: TensorSpec) -> LogicalBlock | None:
    """The first logical block of ``spec`` (what a single-bound baseline uses)."""
    if spec.layout is None:
        return None
    return spec.layout.blocks(spec.shape)[0]


@dataclass
class Materialized:
    """A case's tensors (or model) allocated on a device with a dtype."""

    case: Case
    dtype: torch.dtype
    device: torch.device
    tensors: list[Tensor]
    specs: list[TensorSpec]
    model: nn.Module | None = None

    @property
    def bytes_written(self) -> int:
        """Bytes one init writes (every tensor once)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def materialize(case: Case, dtype: torch.dtype, device: torch.device) -> Materialized:
    """Allocate the case's tensors (zero-filled, so every page is resident before any probe) or build its model."""
    if case.model is not None:
        model = case.model().to(device=device, dtype=dtype)
        params = [p for p in model.parameters() if p.dim() > 1]
        return Materialized(case, dtype, device, [p.data for p in params], [], model)
    tensors: list[Tensor] = []
    specs: list[TensorSpec] = []
    for _ in range(case.copies):
        for spec in case.tensors:
            tensors.append(torch.zeros(spec.shape, dtype=dtype, device=device))
            specs.append(spec)
    return Materialized(case, dtype, device, tensors, specs)


# -- the cases --------------------------------------------------------------------------------


def _mha(e: int) -> Case:
    return Case(
        f"mha_in_proj_E{e}",
        "mha",
        f"nn.MultiheadAttention in_proj_weight ({3 * e}, {e}) = [q; k; v]",
        (TensorSpec("in_proj_weight", (3 * e, e), Layout(0, [e] * 3, names=("q", "k", "v"))),),
        scale=e,
    )


def _rnn(kind: Literal["lstm", "gru"], h: int, layers: int) -> Case:
    gates = 4 if kind == "lstm" else 3
    names = ("i", "f", "g", "o") if kind == "lstm" else ("r", "z", "n")
    lay = Layout(0, [h] * gates, names=names)
    specs = []
    for k in range(layers):
        specs.append(TensorSpec(f"weight_ih_l{k}", (gates * h, h), lay))
        specs.append(TensorSpec(f"weight_hh_l{k}", (gates * h, h), lay))
    return Case(
        f"{kind}_stack_H{h}_L{layers}",
        kind,
        f"nn.{kind.upper()}({h}, {h}, num_layers={layers}): {2 * layers} weights ({gates * h}, {h}), {gates} gates",
        tuple(specs),
        scale=h,
    )


def _gqa(nh: int, nkv: int, d: int) -> Case:
    e = nh * d
    sizes = [nh * d, nkv * d, nkv * d]
    return Case(
        f"gqa_qkv_{nh}q{nkv}kv_d{d}",
        "gqa",
        f"GQA qkv_proj ({sum(sizes)}, {e}): {nh} q heads, {nkv} kv heads, head_dim {d}",
        (TensorSpec("qkv_proj.weight", (sum(sizes), e), Layout(0, sizes, names=("q", "k", "v"))),),
        scale=e,
    )


def _neox(e: int, d: int) -> Case:
    nh = e // d
    return Case(
        f"neox_qkv_E{e}",
        "neox",
        f"GPT-NeoX query_key_value ({3 * e}, {e}): q,k,v interleaved in each of {nh} heads (d={d})",
        (TensorSpec("query_key_value.weight", (3 * e, e), Layout(0, [d] * 3, groups=nh, names=("q", "k", "v"))),),
        scale=e,
    )


def _conv1d(e: int) -> Case:
    return Case(
        f"gpt2_conv1d_E{e}",
        "conv1d",
        f"GPT-2 Conv1D c_attn stored (in, out) = ({e}, {3 * e}): transposed [q | k | v]",
        (TensorSpec("c_attn.weight", (e, 3 * e), Layout(1, [e] * 3, transposed=True, names=("q", "k", "v"))),),
        scale=e,
    )


def _dim1(e: int) -> Case:
    return Case(
        f"dim1_split_E{e}",
        "dim1",
        f"({e}, {3 * e}) packed along dim 1 (three ({e}, {e}) blocks side by side, not transposed)",
        (TensorSpec("weight", (e, 3 * e), Layout(1, [e] * 3)),),
        scale=e,
    )


def _mixtral(n: int, e: int, i: int) -> Case:
    return Case(
        f"moe_mixtral_{n}x{e}x{i}",
        "moe",
        f"stacked experts gate_up ({n}, {2 * i}, {e}): [gate; up] per expert (batch dim 0)",
        (TensorSpec("experts.gate_up_proj", (n, 2 * i, e), Layout(1, [i, i], batch_dims=1, names=("gate", "up"))),),
        scale=e,
    )


def _gptoss(n: int, e: int, i: int) -> Case:
    lay = Layout(2, [1, 1], groups=i, transposed=True, batch_dims=1, names=("gate", "up"))
    return Case(
        f"moe_gptoss_{n}x{e}x{i}",
        "moe",
        f"GPT-OSS experts gate_up ({n}, {e}, {2 * i}) stored (in, out), gate/up interleaved [..., ::2]",
        (TensorSpec("experts.gate_up_proj", (n, e, 2 * i), lay),),
        scale=e,
    )


def _small(n: int, side: int, parts: int) -> Case:
    lay = None if parts == 1 else Layout(0, [side // parts] * parts)
    what = "unpacked (one block each)" if parts == 1 else f"{parts} blocks each"
    return Case(
        f"small_{n}x{side}x{side}" + ("" if parts == 1 else f"_{parts}blk"),
        "small",
        f"{n} separate ({side}, {side}) tensors, {what}: per-call overhead",
        (TensorSpec("w", (side, side), lay),),
        copies=n,
        scale=side,
    )


def _encoder(d: int, layers: int, nhead: int) -> Case:
    def make() -> nn.Module:
        layer = nn.TransformerEncoderLayer(d, nhead, dim_feedforward=4 * d, batch_first=True)
        return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    per_layer = 3 * d * d + d * d + 2 * 4 * d * d
    return Case(
        f"model_encoder_L{layers}_d{d}",
        "model",
        f"nn.TransformerEncoder, {layers} layers, d_model={d}, {nhead} heads, ff={4 * d}",
        scale=d,
        model=make,
        model_params=layers * per_layer,
    )


_GPT2_HOW: dict[str, str] = {
    "chunked": "",
    "apply": ", through model.apply(chunked(f))",
    "init_model": ", through init_model(model, f)",
    "traced": ", traced again on every call",
}


def _gpt2(d: int, layers: int, vocab: int, positions: int, idiom: Idiom = "chunked") -> Case:
    heads = max(1, d // 64)

    def make() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=vocab,
            n_positions=positions,
            n_embd=d,
            n_layer=layers,
            n_head=heads,
            bos_token_id=vocab - 1,
            eos_token_id=vocab - 1,
        )
        return GPT2LMHeadModel(cfg)

    per_layer = 3 * d * d + d * d + 2 * 4 * d * d
    return Case(
        f"model_gpt2_L{layers}_d{d}" + ("" if idiom == "chunked" else f"_{idiom}"),
        "model",
        f"transformers GPT2LMHeadModel from config: {layers} layers, d={d}, vocab {vocab} (tied lm_head)"
        + _GPT2_HOW[idiom],
        scale=d,
        model=make,
        model_params=layers * per_layer + vocab * d + positions * d,
        idiom=idiom,
    )


def _linears(n: int, side: int, idiom: Idiom) -> Case:
    def make() -> nn.Module:
        with torch.device("meta"):  # built without torch's default init; materialised empty
            model = nn.Sequential(*[nn.Linear(side, side) for _ in range(n)])
        return model.to_empty(device="cpu")

    how = {
        "chunked": "chunked(f)(model)",
        "apply": "model.apply(chunked(f))",
        "init_model": "init_model(model, f)",
        "traced": "chunked(f)(model), its trace dropped before every call",
    }
    return Case(
        f"model_linear{n}x{side}_{idiom}",
        "model",
        f"nn.Sequential of {n} nn.Linear({side}, {side}) through {how[idiom]}: per-parameter cost",
        scale=side,
        model=make,
        model_params=n * side * side,
        idiom=idiom,
    )


IDIOMS: tuple[Idiom, ...] = ("chunked", "apply", "init_model")


def build_cases(smoke: bool = False) -> list[Case]:
    """Every case, at full size or (``smoke=True``) at tiny sizes that run in milliseconds."""
    if smoke:
        return [
            _mha(32),
            _rnn("lstm", 16, 2),
            _rnn("gru", 16, 2),
            _gqa(8, 2, 8),
            _neox(32, 8),
            _conv1d(32),
            _dim1(32),
            _mixtral(4, 32, 16),
            _gptoss(4, 32, 16),
            _small(50, 16, 1),
            _small(50, 16, 2),
            _encoder(32, 2, 4),
            _gpt2(32, 2, 128, 64),
            *(_gpt2(32, 2, 128, 64, idiom) for idiom in (*IDIOMS[1:], "traced")),
            *(_linears(20, 8, idiom) for idiom in (*IDIOMS, "traced")),
        ]
    return [
        _mha(1024),
        _mha(4096),
        _mha(8192),
        _rnn("lstm", 1024, 4),
        _rnn("gru", 1024, 4),
        _gqa(64, 8, 128),
        _neox(1024, 64),
        _neox(4096, 128),
        _conv1d(1024),
        _conv1d(4096),
        _dim1(1024),
        _dim1(4096),
        _mixtral(8, 1024, 2048),
        _gptoss(8, 1024, 2048),
        _small(10_000, 64, 1),
        _small(10_000, 64, 2),
        _encoder(768, 12, 12),
        _gpt2(768, 12, 16384, 1024),
        *(_gpt2(768, 12, 16384, 1024, idiom) for idiom in (*IDIOMS[1:], "traced")),
        *(_linears(n, 64, idiom) for n in (2_000, 10_000) for idiom in IDIOMS),
        _linears(2_000, 64, "traced"),
    ]


def select_cases(cases: Sequence[Case], patterns: Sequence[str] | None) -> list[Case]:
    """Cases whose name or family matches any glob pattern (all when ``patterns`` is empty)."""
    if not patterns:
        return list(cases)
    return [
        c for c in cases if any(fnmatch.fnmatchcase(c.name, p) or fnmatch.fnmatchcase(c.family, p) for p in patterns)
    ]
