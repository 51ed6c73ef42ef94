"""Property tests (hypothesis) over random shapes and layouts.

1. every block has the fans and the values-range of a separate tensor of its logical shape;
2. a packed init is bit-identical to initialising separate tensors in block order and packing
   them element by element (the packing is index arithmetic written here, not packedinit's);
7. random (shape, chunks/layout, dim, function, arguments, dtype): success, or PackedInitError
   with the tensor and the global RNG untouched -- never another exception, never a partial write.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor
from torch.nn import init

from packedinit import Layout, PackedInitError, chunked, chunked_init, logical_blocks


@dataclass(frozen=True)
class Packed:
    """A stored shape and a layout that fits it, described by plain numbers."""

    shape: tuple[int, ...]
    dim: int
    sizes: tuple[int, ...]
    groups: int
    transposed: bool
    batch_dims: int
    as_chunks: bool  # pass it as chunks=[sizes]/int with dim (only for plain layouts)

    def call(self) -> dict[str, Any]:
        if self.as_chunks:
            if len(set(self.sizes)) == 1 and len(self.sizes) > 1:  # chunks=1 would mean "exactly fn"
                return {"chunks": len(self.sizes), "dim": self.dim}
            return {"chunks": list(self.sizes), "dim": self.dim}
        return {
            "chunks": Layout(
                self.dim, self.sizes, groups=self.groups, transposed=self.transposed, batch_dims=self.batch_dims
            )
        }

    def batch_indices(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(n) for n in self.shape[: self.batch_dims])))

    def inner_dim(self) -> int:
        return self.dim % len(self.shape) - self.batch_dims

    def logical_shape(self, part: int) -> tuple[int, ...]:
        inner = list(self.shape[self.batch_dims :])
        inner[self.inner_dim()] = self.groups * self.sizes[part]
        if self.transposed:
            inner[0], inner[1] = inner[1], inner[0]
        return tuple(inner)

    def source(self, batch: tuple[int, ...], part: int, logical: tuple[int, ...]) -> tuple[int, ...]:
        """Storage index of a logical element (the spec of a Layout, by hand)."""
        inner = list(logical)
        if self.transposed:
            inner[0], inner[1] = inner[1], inner[0]
        d = self.inner_dim()
        g, r = divmod(inner[d], self.sizes[part])
        inner[d] = g * sum(self.sizes) + sum(self.sizes[:part]) + r
        return (*batch, *inner)

    def order(self) -> list[tuple[tuple[int, ...], int]]:
        """Block order: batch index major, then part."""
        return [(b, j) for b in self.batch_indices() for j in range(len(self.sizes))]

    def pack(self, blocks: list[Tensor], dtype: torch.dtype) -> Tensor:
        out = torch.full(self.shape, float("nan"), dtype=dtype)
        for (b, j), block in zip(self.order(), blocks, strict=True):
            for idx in itertools.product(*(range(n) for n in block.shape)):
                out[self.source(b, j, idx)] = block[idx]
        return out

    def unpack(self, packed: Tensor) -> list[Tensor]:
        out = []
        for b, j in self.order():
            block = torch.empty(self.logical_shape(j), dtype=packed.dtype)
            for idx in itertools.product(*(range(n) for n in block.shape)):
                block[idx] = packed[self.source(b, j, idx)]
            out.append(block)
        return out


@st.composite
def packed_layouts(draw: st.DrawFn, min_inner: int = 1, max_numel: int = 240) -> Packed:
    batch = draw(st.lists(st.integers(1, 2), max_size=2))
    n_inner = draw(st.integers(min_inner, 3))
    transposed = draw(st.booleans()) if n_inner >= 2 else False
    sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    groups = draw(st.integers(1, 3))
    inner = draw(st.lists(st.integers(1, 4), min_size=n_inner, max_size=n_inner))
    d_inner = draw(st.integers(0, n_inner - 1))
    inner[d_inner] = groups * sum(sizes)
    shape = (*batch, *inner)
    if math.prod(shape) > max_numel:
        shape = (*inner,)
        batch = []
    dim = len(batch) + d_inner
    if draw(st.booleans()):
        dim -= len(shape)
    plain = groups == 1 and not transposed and not batch
    return Packed(shape, dim, sizes, groups, transposed, len(batch), plain and draw(st.booleans()))


def bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def fans(shape: tuple[int, ...]) -> tuple[int, int]:
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


# -- 1 -----------------------------------------------------------------------------------------------------------------
@given(packed_layouts(min_inner=2), st.floats(0.5, 2.0))
def test_blocks_have_their_own_fans_and_bounds(p: Packed, gain: float) -> None:
    blocks = logical_blocks(p.shape, **p.call())
    assert [(b.batch_index, b.part) for b in blocks] == p.order()
    for b in blocks:
        assert tuple(b.shape) == p.logical_shape(b.part)
        assert (b.fan_in, b.fan_out) == init._calculate_fan_in_and_fan_out(torch.empty(p.logical_shape(b.part)))
    w = chunked_init(torch.empty(p.shape), **p.call(), init_fn=init.xavier_uniform_, gain=gain)
    for (_, j), block in zip(p.order(), p.unpack(w), strict=True):
        fi, fo = fans(p.logical_shape(j))
        assert float(block.abs().max()) <= gain * math.sqrt(6 / (fi + fo)) * (1 + 1e-6)
    w = chunked_init(torch.empty(p.shape), **p.call(), init_fn=init.kaiming_uniform_, mode="fan_out")
    for (_, j), block in zip(p.order(), p.unpack(w), strict=True):
        _, fo = fans(p.logical_shape(j))
        assert float(block.abs().max()) <= math.sqrt(2) * math.sqrt(3 / fo) * (1 + 1e-6)


# -- 2 -----------------------------------------------------------------------------------------------------------------
FNS: list[tuple[str, Callable[..., Tensor], dict[str, Any]]] = [
    ("uniform_", init.uniform_, {"a": -2.0, "b": 1.0}),
    ("normal_", init.normal_, {"std": 3.0}),
    ("trunc_normal_", init.trunc_normal_, {}),
    ("xavier_uniform_", init.xavier_uniform_, {}),
    ("xavier_normal_", init.xavier_normal_, {"gain": 0.5}),
    ("kaiming_uniform_", init.kaiming_uniform_, {"a": 2.2}),
    ("kaiming_normal_", init.kaiming_normal_, {"mode": "fan_out"}),
    ("orthogonal_", init.orthogonal_, {}),
    ("sparse_", init.sparse_, {"sparsity": 0.5}),
    ("eye_", init.eye_, {}),
    ("dirac_", init.dirac_, {}),
    ("constant_", init.constant_, {"val": -1.5}),
]


#: Drawn in stored orientation on transposed storage (packedinit.orient): i.i.d. per element given the fans.
STORED = frozenset(
    {init.uniform_, init.normal_, init.trunc_normal_, init.xavier_uniform_, init.xavier_normal_}
    | {init.kaiming_uniform_, init.kaiming_normal_, init.constant_, init.ones_, init.zeros_}
)


def block_reference(
    p: Packed, fn: Callable[..., Tensor], shape: tuple[int, ...], dtype: torch.dtype, kw: dict[str, Any]
) -> Tensor:
    """A separate tensor for one block (logical shape); on transposed storage, for functions in STORED,
    torch's function on the stored ``(in, out, ...)`` tensor with the logical fans, seen as ``(out, in, ...)``."""
    if not (p.transposed and fn in STORED):
        return fn(torch.empty(shape, dtype=dtype), **kw)
    t = torch.empty((shape[1], shape[0], *shape[2:]), dtype=dtype)
    if fn in (init.uniform_, init.xavier_uniform_, init.kaiming_uniform_):
        fn(t.transpose(0, 1), **kw)  # CPU uniform_ fills in memory order
    elif fn is init.kaiming_normal_:
        fn(t, **{**kw, "mode": {"fan_in": "fan_out", "fan_out": "fan_in"}[kw.get("mode", "fan_in")]})
    else:
        fn(t, **kw)  # fan-independent, or symmetric in the fans (xavier_normal_)
    return t.transpose(0, 1)


@given(packed_layouts(), st.sampled_from(FNS), st.sampled_from([torch.float32, torch.float64]), st.booleans())
def test_bit_identical_to_separate_tensors(
    p: Packed, spec: tuple[str, Callable[..., Tensor], dict[str, Any]], dtype: torch.dtype, contiguous: bool
) -> None:
    _, fn, kw = spec
    torch.manual_seed(7)
    try:
        separate = [block_reference(p, fn, p.logical_shape(j), dtype, kw) for _, j in p.order()]
    except ValueError:
        separate = None
    w = torch.randn(p.shape, dtype=torch.float64).to(dtype)
    if not contiguous and w.dim() >= 2:  # the same values, stored with other strides
        w = w.transpose(0, -1).contiguous().transpose(0, -1)
    before = bits(w)
    torch.manual_seed(7)
    if separate is None:
        with pytest.raises(PackedInitError, match=r"rejected (block|the tensor)"):
            chunked_init(w, **p.call(), init_fn=fn, **kw)
        assert torch.equal(bits(w), before)
        return
    assert chunked_init(w, **p.call(), init_fn=fn, **kw) is w
    want = p.pack(separate, dtype)
    assert torch.equal(bits(w), bits(want))


@given(st.lists(st.integers(0, 4), max_size=3), st.sampled_from(FNS), st.booleans())
def test_unpacked_is_the_plain_function(
    shape: list[int], spec: tuple[str, Callable[..., Tensor], dict[str, Any]], chunks1: bool
) -> None:
    _, fn, kw = spec
    if chunks1 and not shape:
        return
    torch.manual_seed(3)
    try:
        want: Tensor | None = fn(torch.zeros(shape), **kw) if math.prod(shape) else torch.zeros(shape)
    except ValueError:
        want = None
    t = torch.zeros(shape)
    torch.manual_seed(3)
    if want is None:
        with pytest.raises(PackedInitError):
            chunked(fn, 1 if chunks1 else None)(t, **kw)
        assert torch.equal(t, torch.zeros(shape))
        return
    assert torch.equal(bits(chunked(fn, 1 if chunks1 else None)(t, **kw)), bits(want))


# -- 7 -----------------------------------------------------------------------------------------------------------------
CALLS: list[tuple[Callable[..., Tensor], dict[str, Any]]] = [
    *((fn, kw) for _, fn, kw in FNS),
    (init.kaiming_uniform_, {"mode": "fan_middle"}),
    (init.kaiming_normal_, {"nonlinearity": "swish"}),
    (init.xavier_uniform_, {"gain": -1.0}),
    (init.xavier_uniform_, {"gian": 1.0}),
    (init.uniform_, {"a": 1.0, "b": -1.0}),
    (init.trunc_normal_, {"a": 3.0, "b": 2.0}),
    (init.normal_, {"std": -0.5}),
    (init.constant_, {"val": "x"}),
    (init.constant_, {}),
    (init.dirac_, {"groups": 0}),
    (init.dirac_, {"groups": 2}),
    (init.sparse_, {}),
    (init.sparse_, {"sparsity": 0.1, "std": -1.0}),
    (init.zeros_, {"generator": "not a generator"}),
    (init.orthogonal_, {"gain": 0.5}),
]

layout_params = st.fixed_dictionaries(
    {
        "dim": st.integers(-4, 3),
        "sizes": st.lists(st.integers(-1, 4), max_size=3),
        "groups": st.integers(0, 3),
        "transposed": st.booleans(),
        "batch_dims": st.integers(0, 3),
    }
)
chunk_args = st.one_of(
    st.none(),
    st.integers(-1, 5),
    st.lists(st.integers(-1, 5), max_size=4),
    layout_params,
    st.sampled_from(["3", 2.0, True]),
)


@pytest.mark.filterwarnings("ignore:mean is more than 2 std from")  # torch's own warning for trunc_normal_(a > b)
@given(
    st.lists(st.integers(0, 5), max_size=4),
    chunk_args,
    st.one_of(st.none(), st.integers(-5, 4)),
    st.lists(st.sampled_from(CALLS), min_size=1, max_size=3),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]),
    st.booleans(),
)
def test_all_or_nothing(
    shape: list[int],
    chunks: Any,
    dim: int | None,
    calls: list[tuple[Callable[..., Tensor], dict[str, Any]]],
    dtype: torch.dtype,
    per_block: bool,
) -> None:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = bits(t)
    rng = torch.get_rng_state()
    fn, kw = calls[0]
    init_fn: Any = [c[0] for c in calls] if per_block else fn
    try:
        spec = Layout(**chunks) if isinstance(chunks, dict) else chunks
        out = chunked_init(t, spec, dim, init_fn, **kw)
    except PackedInitError:
        assert torch.equal(bits(t), before), "a PackedInitError after a write"
        assert torch.equal(torch.get_rng_state(), rng)
    else:
        assert out is t
