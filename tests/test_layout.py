"""Layout: value semantics, validation, block shapes and fans, and the index maps.

The index maps (``storage_view``/``to_storage``/``logical_view``) are checked against
element-by-element index arithmetic written here, never against Layout itself.
"""

from __future__ import annotations

import copy
import itertools
import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from packedinit import Layout, LogicalBlock, PackedInitError, logical_blocks
from packedinit.engine.chunks import as_layout


def storage_index(
    stored_shape: tuple[int, ...],
    *,
    dim: int,
    sizes: tuple[int, ...],
    groups: int,
    transposed: bool,
    batch_dims: int,
    batch: tuple[int, ...],
    part: int,
    logical: tuple[int, ...],
) -> tuple[int, ...]:
    """Where logical element ``logical`` of block (batch, part) lives in storage: the spec, by hand."""
    ndim = len(stored_shape)
    d = dim % ndim - batch_dims  # packed dim within the matrix dims
    inner = list(logical)
    if transposed:
        inner[0], inner[1] = inner[1], inner[0]
    g, r = divmod(inner[d], sizes[part])
    inner[d] = g * sum(sizes) + sum(sizes[:part]) + r
    return (*batch, *inner)


def logical_shape(stored_shape: tuple[int, ...], layout_kw: dict[str, Any], part: int) -> tuple[int, ...]:
    """The logical shape of a block, by hand."""
    dim = int(layout_kw["dim"])
    bd = int(layout_kw.get("batch_dims", 0))
    groups = int(layout_kw.get("groups", 1))
    sizes = tuple(layout_kw["sizes"])
    inner = list(stored_shape[bd:])
    inner[dim % len(stored_shape) - bd] = groups * sizes[part]
    if layout_kw.get("transposed", False):
        inner[0], inner[1] = inner[1], inner[0]
    return tuple(inner)


# The rows of DESIGN.md's layout table, at small sizes: (name, stored shape, Layout kwargs).
E, H, D, NH, NKV, NEXP, INTER = 8, 4, 2, 4, 2, 3, 4
TABLE: list[tuple[str, tuple[int, ...], dict[str, Any]]] = [
    ("mha", (3 * E, E), {"dim": 0, "sizes": (E, E, E), "names": ("q", "k", "v")}),
    ("lstm", (4 * H, 5), {"dim": 0, "sizes": (H,) * 4, "names": ("i", "f", "g", "o")}),
    ("gqa", ((NH + 2 * NKV) * D, E), {"dim": 0, "sizes": (NH * D, NKV * D, NKV * D)}),
    ("neox", (NH * 3 * D, E), {"dim": 0, "sizes": (D, D, D), "groups": NH}),
    ("falcon", (NKV * (NH // NKV + 2) * D, E), {"dim": 0, "sizes": ((NH // NKV) * D, D, D), "groups": NKV}),
    ("gpt2_conv1d", (E, 3 * E), {"dim": 1, "sizes": (E, E, E), "transposed": True}),
    (
        "gpt_oss",
        (NEXP, E, 2 * INTER),
        {"dim": 2, "sizes": (1, 1), "groups": INTER, "transposed": True, "batch_dims": 1},
    ),
    ("mixtral", (NEXP, 2 * INTER, E), {"dim": 1, "sizes": (INTER, INTER), "batch_dims": 1}),
    ("dim1_negative", (E, 2 * E, 3), {"dim": -2, "sizes": (E, E)}),
    ("conv_dim0", (3 * E, 2, 3, 3), {"dim": 0, "sizes": (E, E, E)}),
]


@pytest.mark.parametrize(("name", "shape", "kw"), TABLE, ids=[t[0] for t in TABLE])
def test_blocks_shapes_fans_and_order(name: str, shape: tuple[int, ...], kw: dict[str, Any]) -> None:
    layout = Layout(**kw)
    blocks = layout.blocks(shape)
    bd = int(kw.get("batch_dims", 0))
    batch_indices = list(itertools.product(*(range(n) for n in shape[:bd])))
    parts = len(kw["sizes"])
    assert len(blocks) == len(batch_indices) * parts
    # block order: batch index major, then part
    assert [(b.batch_index, b.part) for b in blocks] == [(bi, j) for bi in batch_indices for j in range(parts)]
    assert [b.index for b in blocks] == list(range(len(blocks)))
    for b in blocks:
        want = logical_shape(shape, kw, b.part)
        assert tuple(b.shape) == want
        fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(torch.empty(want))
        assert (b.fan_in, b.fan_out) == (fan_in, fan_out)
        assert b.numel == math.prod(want)
        names = kw.get("names")
        assert b.name == (names[b.part] if names else None)


@pytest.mark.parametrize(("name", "shape", "kw"), TABLE, ids=[t[0] for t in TABLE])
def test_index_maps_match_hand_arithmetic(name: str, shape: tuple[int, ...], kw: dict[str, Any]) -> None:
    layout = Layout(**kw)
    stored = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    seen = torch.zeros(shape, dtype=torch.int64)
    for b in layout.blocks(shape):
        # the logical block, gathered element by element with the hand-written map
        want = torch.empty(b.shape, dtype=torch.float64)
        for idx in itertools.product(*(range(n) for n in b.shape)):
            src = storage_index(
                shape,
                dim=int(kw["dim"]),
                sizes=tuple(kw["sizes"]),
                groups=int(kw.get("groups", 1)),
                transposed=bool(kw.get("transposed", False)),
                batch_dims=int(kw.get("batch_dims", 0)),
                batch=b.batch_index,
                part=b.part,
                logical=idx,
            )
            want[idx] = stored[src]
            seen[src] += 1
        # storage_view is a view of the storage; to_storage maps the logical block onto it
        sv = layout.storage_view(stored, b)
        assert sv.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr()
        assert torch.equal(sv, layout.to_storage(want, b, len(shape)))
        lv = layout.logical_view(stored, b)
        if lv is not None:
            assert torch.equal(lv, want)
        # writing through storage_view touches exactly the block's elements
        probe = torch.zeros(shape, dtype=torch.float64)
        layout.storage_view(probe, b).copy_(layout.to_storage(want + 1, b, len(shape)))
        assert int((probe != 0).sum()) == b.numel
    assert bool((seen == 1).all()), "blocks must tile the tensor exactly once"


def test_logical_view_exists_exactly_when_a_view_can_express_the_block() -> None:
    w = torch.empty(3 * E, E)
    mha = Layout(0, [E, E, E])
    assert all(mha.logical_view(w, b) is not None for b in mha.blocks(w.shape))
    assert all(mha.logical_view(w, b).is_contiguous() for b in mha.blocks(w.shape))  # type: ignore[union-attr]
    neox = Layout(0, [D, D, D], groups=NH)
    assert all(neox.logical_view(torch.empty(NH * 3 * D, E), b) is None for b in neox.blocks((NH * 3 * D, E)))
    split1 = Layout(1, [E, E])
    views = [split1.logical_view(torch.empty(E, 2 * E), b) for b in split1.blocks((E, 2 * E))]
    assert all(v is not None and not v.is_contiguous() for v in views)


def test_value_semantics_hash_eq_pickle_copy() -> None:
    a = Layout(dim=0, sizes=[E, E, E], names=("q", "k", "v"))
    b = Layout(0, (E, E, E), names=["q", "k", "v"])
    c = Layout(0, (E, E, E))
    assert a == b
    assert hash(a) == hash(b)
    assert a != c
    assert a != Layout(0, (E, E, E), names=("q", "k", "w"))
    assert Layout(0, [2], groups=2) != Layout(0, [2]) != Layout(0, [2], transposed=True)
    assert Layout(1, [2], batch_dims=1) != Layout(1, [2])
    assert a != "Layout(dim=0, ...)"
    assert len({a, b, c}) == 2
    assert {a: 1}[b] == 1
    for obj in (a, Layout(dim=2, sizes=[1, 1], groups=16, transposed=True, batch_dims=1)):
        restored = pickle.loads(pickle.dumps(obj))
        assert restored == obj
        assert hash(restored) == hash(obj)
        assert repr(restored) == repr(obj)
    assert copy.copy(a) is a
    assert copy.deepcopy(a) is a
    assert a.sizes == (E, E, E)
    assert a.names == ("q", "k", "v")
    assert a.packed_size == 3 * E
    assert a.num_parts == 3


def test_immutable() -> None:
    a = Layout(0, [2, 2])
    with pytest.raises(AttributeError, match="immutable"):
        a._dim = 1
    with pytest.raises(AttributeError, match="immutable"):
        del a._sizes
    with pytest.raises(AttributeError):
        a.dim = 1  # type: ignore[misc]
    assert a.dim == 0
    assert a.sizes == (2, 2)


def test_repr_roundtrips_and_says_what_it_is() -> None:
    ns = {"Layout": Layout}
    for layout in (
        Layout(0, [E, E, E], names=("q", "k", "v")),
        Layout(0, [D, D, D], groups=NH),
        Layout(1, [E, E, E], transposed=True),
        Layout(dim=2, sizes=[1, 1], groups=INTER, transposed=True, batch_dims=1),
        Layout(-1, [3]),
    ):
        assert eval(repr(layout), ns) == layout
    r = repr(Layout(dim=2, sizes=[1, 1], groups=16, transposed=True, batch_dims=1))
    assert r == "Layout(dim=2, sizes=(1, 1), groups=16, transposed=True, batch_dims=1)"
    assert repr(Layout(0, [4])) == "Layout(dim=0, sizes=(4,))"


def test_describe_in_words() -> None:
    assert Layout(0, [E, E, E], names=("q", "k", "v")).describe() == (
        "dim 0 = [q:8 | k:8 | v:8]: 3 blocks (q, k, v), each presented to init functions on its own"
    )
    neox = Layout(0, [D, D, D], groups=NH).describe()
    assert neox.startswith("dim 0 = 4 x [part0:2 | part1:2 | part2:2]: 3 blocks interleaved in 4 groups")
    assert "(group, row) order" in neox
    assert "stored (in, out) and presented as (out, in)" in Layout(1, [E] * 3, transposed=True).describe()
    assert "each index of dim 0 (a batch dim)" in Layout(1, [4, 4], batch_dims=1).describe()
    assert "dims 0..1 (batch dims)" in Layout(2, [4, 4], batch_dims=2).describe()
    assert Layout(0, [4]).describe().startswith("dim 0 = [part0:4]: 1 block,")


def test_part_index() -> None:
    a = Layout(0, [1, 2, 3], names=("q", "k", "v"))
    assert [a.part_index(p) for p in ("q", "k", "v", 0, 1, 2, -1)] == [0, 1, 2, 0, 1, 2, 2]
    with pytest.raises(PackedInitError, match="no part named 'x'; known names: \\['q', 'k', 'v'\\]"):
        a.part_index("x")
    with pytest.raises(PackedInitError, match=r"no part 3; parts are 0\.\.2"):
        a.part_index(3)
    with pytest.raises(PackedInitError, match="has no names"):
        Layout(0, [1, 2]).part_index("q")


def test_integer_like_arguments_are_accepted() -> None:
    a = Layout(np.int64(0), [np.int64(4), np.int32(4)], groups=np.int16(2), batch_dims=np.int8(0))
    assert a == Layout(0, [4, 4], groups=2)
    assert type(a.dim) is int
    assert all(type(s) is int for s in a.sizes)
    assert Layout(torch.tensor(1), [torch.tensor(3)]) == Layout(1, [3])  # type: ignore[arg-type, list-item]
    assert as_layout([np.int64(2), 2], 0, (4, 3)) == Layout(0, [2, 2])
    assert as_layout(np.int64(2), np.int64(1), (3, 4)) == Layout(1, [2, 2])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 0, "sizes": []}, "sizes is empty"),
        ({"dim": 0, "sizes": [4, 0]}, "every size must be a positive int, got 0"),
        ({"dim": 0, "sizes": [4, -1]}, "every size must be a positive int, got -1"),
        ({"dim": 0, "sizes": [4, 2.0]}, "every size must be a positive int, got 2.0"),
        ({"dim": 0, "sizes": [True, 2]}, "every size must be a positive int, got True"),
        ({"dim": 0, "sizes": "444"}, "sizes must be a sequence of positive ints"),
        ({"dim": 0, "sizes": 4}, "sizes must be a sequence of positive ints"),
        ({"dim": 0.0, "sizes": [4]}, "dim must be an int"),
        ({"dim": True, "sizes": [4]}, "dim must be an int"),
        ({"dim": 0, "sizes": [4], "groups": 0}, "groups must be a positive int, got 0"),
        ({"dim": 0, "sizes": [4], "groups": 1.5}, "groups must be a positive int"),
        ({"dim": 0, "sizes": [4], "transposed": 1}, "transposed must be a bool, got 1"),
        ({"dim": 0, "sizes": [4], "batch_dims": -1}, "batch_dims must be a non-negative int, got -1"),
        ({"dim": 0, "sizes": [4, 4], "names": "qk"}, "names must be a sequence of strings"),
        ({"dim": 0, "sizes": [4, 4], "names": ("q",)}, "1 names \\('q',\\) for 2 sizes; give one name per part"),
        ({"dim": 0, "sizes": [4, 4], "names": ("q", "q")}, "repeat; part names must be unique"),
        ({"dim": 0, "sizes": [4, 4], "names": ("q", "")}, "every name must be a non-empty string"),
        ({"dim": 0, "sizes": [4, 4], "names": ("q", 1)}, "every name must be a non-empty string, got 1"),
    ],
)
def test_bad_layouts(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PackedInitError, match=match):
        Layout(**kwargs)


@pytest.mark.parametrize(
    ("layout", "shape", "match"),
    [
        (
            Layout(0, [4, 4]),
            (9, 3),
            r"dim 0 has length 9 but the layout needs sum\[4, 4\] = 8; fix sizes/groups or dim",
        ),
        (Layout(0, [2, 2], groups=3), (13, 3), r"needs 3 x sum\[2, 2\] = 12"),
        (Layout(2, [4]), (4, 4), r"dim 2 is out of range for a 2-D tensor; use a dim in \[-2, 1\]"),
        (Layout(-3, [4]), (4, 4), r"dim -3 is out of range"),
        (Layout(1, [4], batch_dims=2), (2, 4), r"batch_dims=2 leaves no dims for the matrix; use batch_dims < 2"),
        (Layout(0, [4], batch_dims=1), (4, 4, 4), r"the packed dim 0 is one of the 1 batch dims"),
        (Layout(1, [4], transposed=True, batch_dims=1), (3, 4), r"transposed=True needs at least 2 dims"),
        (Layout(0, [4]), (), r"a 0-D tensor has no dim to pack"),
    ],
)
def test_layout_does_not_fit_shape(layout: Layout, shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(PackedInitError, match=match) as info:
        layout.check(shape, param="attn.in_proj_weight")
    assert "parameter 'attn.in_proj_weight'" in str(info.value)
    assert repr(layout) in str(info.value)
    with pytest.raises(PackedInitError, match=match):
        layout.blocks(shape)


def test_as_layout_of_public_arguments() -> None:
    assert as_layout(None, None, (6, 4)) == Layout(0, [6])
    assert as_layout(1, None, (6, 4)) == Layout(0, [6])
    assert as_layout(3, 0, (6, 4)) == Layout(0, [2, 2, 2])
    assert as_layout(2, -1, (6, 4)) == Layout(-1, [2, 2])
    assert as_layout([4, 1, 1], None, (6, 4)) == Layout(0, [4, 1, 1])
    assert as_layout((1, 3), 1, (6, 4)) == Layout(1, [1, 3])
    lay = Layout(1, [2, 2])
    assert as_layout(lay, None, (6, 4)) is lay
    assert as_layout(lay, 1, (6, 4)) is lay
    assert as_layout(lay, -1, (6, 4)) is lay  # the same dim, spelled differently
    assert as_layout(3, 0, (0, 4)) is None  # nothing to initialise
    assert as_layout(None, 0, (0, 4)) is None


def test_logical_blocks_public_fans() -> None:
    mha = nn.MultiheadAttention(E, 2)
    blocks = logical_blocks(mha.in_proj_weight, 3)
    assert [(tuple(b.shape), b.fan_in, b.fan_out) for b in blocks] == [((E, E), E, E)] * 3
    assert logical_blocks((3 * E, E), Layout(0, [E] * 3, names=("q", "k", "v")))[1].label == "k"
    experts = logical_blocks(torch.empty(NEXP, E, 2 * INTER, device="meta"), Layout(**TABLE[6][2]))
    assert len(experts) == 2 * NEXP
    assert experts[3].label == "[1] part 1"
    assert (experts[3].fan_in, experts[3].fan_out) == (E, INTER)
    assert logical_blocks((4,), 2)[0].fan_in is None
    assert logical_blocks((0, 4), 2) == ()
    assert isinstance(blocks[0], LogicalBlock)
    with pytest.raises(PackedInitError, match="which 5 equal chunks cannot divide"):
        logical_blocks((6, 4), 5)
