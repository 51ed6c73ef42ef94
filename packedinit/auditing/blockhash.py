r"""One read pass over a box of a logical block: a storage-independent 64-bit hash and float64 sums.

A logical block of shape :math:`L` is fingerprinted through *boxes*: strided views of the tensor
(the local shard of a DTensor included) whose view dim :math:`k` holds logical positions
:math:`o_k, o_k + 1, \dots` with logical row-major stride :math:`s_k`, so element :math:`x` of the
box has logical flat index :math:`i = \sum_k (x_k + o_k)\, s_k`. The hash is

.. math::
    H = \mathrm{fmix64}\Big(\sum_i A^{i}\, m(b_i) \bmod 2^{64}\Big),\qquad m(b) = b \oplus (b \gg w/2),

with :math:`b_i` the value's :math:`w`-bit pattern (:math:`m` computed in :math:`w` bits, then
sign-extended to 64), :math:`A` an odd constant and
``fmix64`` the splitmix64 finaliser (the block's element count enters the final mix too, see
:func:`block_hash`; :math:`\gg` is the logical shift). :math:`m` is a bijection of :math:`w`-bit integers
(linear over GF(2), so not over the integers: the sum is no plain polynomial hash of the bits) and
:math:`A^i` is odd, so every single changed value changes
:math:`H`; the sum does not depend on the order of the elements, so boxes and shards add; and
:math:`A^i = \prod_k (A^{s_k})^{x_k + o_k}`, so a box is contracted one view dim at a time with
a vector of powers (an int64 matrix-vector product) instead of a per-element index. torch's
int64 arithmetic wraps modulo :math:`2^{64}` (checked by the tests against Python integers).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import Tensor

__all__ = [
    "CHUNK",
    "DEVICE_CHUNK",
    "Box",
    "Sums",
    "block_hash",
    "box_sums",
    "contract",
    "fmix64",
    "hashable",
    "many_box_sums",
    "powers",
]

#: Elements read per step (about 512 KiB of int64: the pass stays in cache; memory O(chunk)).
CHUNK: int = 1 << 16
#: Elements read per step on an accelerator (fewer launches and host syncs; 128 MiB of int64).
DEVICE_CHUNK: int = 1 << 24
_A = 0x9E3779B97F4A7C15  # odd: every power is odd, so A^i * x is a bijection of x
_MOD = 1 << 64
_MASK = _MOD - 1
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: A strided view of part of a logical block and, per view dim, ``(offset, logical stride)``.
Box: TypeAlias = tuple[Tensor, tuple[tuple[int, int], ...]]


def _signed(v: int) -> int:
    v &= _MASK
    return v - _MOD if v >> 63 else v


def fmix64(x: int) -> int:
    """The splitmix64 finaliser (a bijection of 64-bit integers), on a Python int.

    Examples:
        >>> f"{fmix64(0):016x}", f"{fmix64(1):016x}"
        ('0000000000000000', '5692161d100b05e5')
    """
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def block_hash(raw: int, count: int) -> str:
    """The block's hash (16 hex digits) from its raw sum and its number of elements.

    ``fmix64(raw ^ fmix64(count + C))``: the count enters so that all-zero blocks of different sizes differ.

    Examples:
        >>> block_hash(0, 6) != block_hash(0, 9)
        True
    """
    return f"{fmix64(raw ^ fmix64(count + 0x243F6A8885A308D3)):016x}"


def powers(base: int, start: int, n: int, device: torch.device) -> Tensor:
    """``[base**start, base**(start+1), ..., base**(start+n-1)] mod 2**64`` as int64 (doubling, O(n) work).

    Examples:
        >>> powers(3, 2, 4, torch.device("cpu")).tolist()
        [9, 27, 81, 243]
    """
    out = torch.tensor([_signed(pow(base, start, _MOD))], dtype=torch.int64, device=device)
    while out.numel() < n:
        out = torch.cat([out, out * _signed(pow(base, out.numel(), _MOD))])
    return out[:n]


def hashable(t: Tensor) -> bool:
    """Whether the fingerprint reads ``t``'s values: real floating, integer and bool tensors off the meta device."""
    return not t.is_meta and not t.is_complex() and t.element_size() in _BITS


@dataclass
class Sums:
    """What one pass accumulates: the raw hash sum and the float64 sums of the finite values.

    Attributes:
        raw: :math:`\\sum_i A^i g(b_i) \\bmod 2^{64}` (an unsigned Python int).
        count: elements read.
        finite: finite elements among them (the float statistics cover these only).
        s1: float64 sum of the finite values.
        s2: float64 sum of their squares.
        lo: smallest finite value (``inf`` when none).
        hi: largest finite value (``-inf`` when none).
    """

    raw: int = 0
    count: int = 0
    finite: int = 0
    s1: float = 0.0
    s2: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf

    def add(self, other: Sums) -> None:
        """Add ``other``'s elements (order independent for everything but float rounding)."""
        self.raw = (self.raw + other.raw) & _MASK
        self.count += other.count
        self.finite += other.finite
        self.s1 += other.s1
        self.s2 += other.s2
        self.lo = min(self.lo, other.lo)
        self.hi = max(self.hi, other.hi)


def contract(g: Tensor, w: Tensor) -> Tensor:
    """``g @ w`` over the last dim, in int64 modulo 2**64 (a matrix-vector product on CPU; CUDA has no int64 matmul).

    Examples:
        >>> g, w = torch.arange(6).reshape(2, 3), torch.tensor([1, 10, 100])
        >>> contract(g, w).tolist(), (g * w).sum(-1).tolist()
        ([210, 543], [210, 543])
    """
    if g.device.type == "cpu":
        return torch.matmul(g, w)
    return (g * w).sum(-1)


def _mixed(c: Tensor) -> Tensor:
    """``m(b) = b ^ (b >>> w/2)`` of the values' ``w``-bit patterns ``b``, sign-extended to int64.

    A bijection of ``w``-bit integers (linear over GF(2)), computed at the values' own width (cheaper
    than in int64), then widened.
    """
    x = c.view(_BITS[c.element_size()])
    half = 4 * c.element_size()
    t = torch.bitwise_right_shift(x, half)
    t.bitwise_and_((1 << half) - 1)  # >> is arithmetic: keep the logical shift's bits only
    return t.bitwise_xor_(x).to(torch.int64)


def _read(c: Tensor, ws: Sequence[Tensor], factor: int, acc: Sums) -> None:
    """One chunk: its hash contribution (contracted dim by dim with the power vectors) and float64 sums."""
    g = _mixed(c)
    for w in reversed(ws[1:]):
        g = contract(g, w)
    h = int((g * ws[0]).sum())
    acc.raw = (acc.raw + factor * h) & _MASK
    n = c.numel()
    acc.count += n
    cd = c.to(torch.float64).reshape(-1)
    s1, s2 = torch.stack([cd.sum(), torch.dot(cd, cd)]).tolist()
    if math.isfinite(s1) and math.isfinite(s2):
        finite = n
        lo, hi = torch.stack([c.min(), c.max()]).tolist() if n else (math.inf, -math.inf)
    else:  # nan/inf inside (or a float64 overflow): the statistics leave them out
        keep = torch.isfinite(cd)
        finite = int(keep.sum())
        cd = cd[keep]
        s1, s2 = torch.stack([cd.sum(), torch.dot(cd, cd)]).tolist()
        lo, hi = torch.stack([cd.min(), cd.max()]).tolist() if finite else (math.inf, -math.inf)
    acc.finite += finite
    acc.s1 += s1
    acc.s2 += s2
    acc.lo = min(acc.lo, float(lo))
    acc.hi = max(acc.hi, float(hi))


def _walk(v: Tensor, ws: Sequence[Tensor], factor: int, acc: Sums, chunk: int) -> None:
    n = v.numel()
    if n <= chunk:
        _read(v, ws, factor, acc)
        return
    inner = n // v.shape[0]
    if inner <= chunk:
        rows = max(1, chunk // inner)
        for a in range(0, v.shape[0], rows):
            _read(v[a : a + rows], [ws[0][a : a + rows], *ws[1:]], factor, acc)
        return
    for i in range(v.shape[0]):  # one slice is bigger than a chunk: go one dim down
        _walk(v[i], ws[1:], (factor * int(ws[0][i])) & _MASK, acc, chunk)


def box_sums(view: Tensor, dims: Sequence[tuple[int, int]], chunk: int = CHUNK) -> Sums:
    """Hash and sums of one box: ``dims[k] = (offset, logical stride)`` of view dim ``k`` (see the module docstring).

    Read-only; memory O(``chunk``) beyond power vectors as long as the box's dims.

    Examples:
        >>> w = torch.arange(6.0).reshape(2, 3)
        >>> a = box_sums(w, [(0, 3), (0, 1)])  # the whole (2, 3) matrix, row-major
        >>> b = box_sums(w.t().contiguous().t(), [(0, 3), (0, 1)])  # the same values, column-major storage
        >>> a.raw == b.raw, a.count, a.s1, a.hi
        (True, 6, 15.0, 5.0)
        >>> top, bottom = box_sums(w[:1], [(0, 3), (0, 1)]), box_sums(w[1:], [(1, 3), (0, 1)])
        >>> (top.raw + bottom.raw) % 2**64 == a.raw  # boxes (shards) add up
        True
    """
    acc = Sums()
    if view.numel() == 0:
        return acc
    with torch.no_grad():
        _walk(view, _weights(tuple(dims), tuple(view.shape), view.device), 1, acc, chunk)
    return acc


@functools.lru_cache(maxsize=1024)
def _weights(dims: tuple[tuple[int, int], ...], shape: tuple[int, ...], device: torch.device) -> list[Tensor]:
    """The power vectors of a box (cached: many parameters share a shape; never written to)."""
    return [powers(pow(_A, s, _MOD), o, n, device) for (o, s), n in zip(dims, shape, strict=True)]


def _read_batch(views: Sequence[Tensor], ws: Sequence[Tensor], accs: Sequence[Sums]) -> None:
    """Boxes of one shape and one set of weights, stacked: a few ops for all of them."""
    x = torch.stack(list(views))
    b = x.shape[0]
    n = x[0].numel()
    cd = x.to(torch.float64).reshape(b, -1)
    s1, s2 = cd.sum(1), (cd * cd).sum(1)
    if not bool((torch.isfinite(s1) & torch.isfinite(s2)).all()):  # nan/inf somewhere: one box at a time
        for v, acc in zip(views, accs, strict=True):
            _read(v, ws, 1, acc)
        return
    g = _mixed(x)
    for w in reversed(ws):
        g = contract(g, w)
    flat = x.reshape(b, -1)
    lo, hi = flat.amin(1), flat.amax(1)
    for acc, *vals in zip(accs, g.tolist(), s1.tolist(), s2.tolist(), lo.tolist(), hi.tolist(), strict=True):
        raw, a, q, mn, mx = vals
        acc.add(Sums(raw & _MASK, n, n, a, q, float(mn), float(mx)))


def many_box_sums(boxes: Sequence[Box], chunk: int = CHUNK) -> list[Sums]:
    """:func:`box_sums` of every box; small boxes of one shape are read together (stacked, ``chunk`` at a time).

    Examples:
        >>> ws = [torch.randn(4, 4) for _ in range(3)]
        >>> dims = ((0, 4), (0, 1))
        >>> [s.raw for s in many_box_sums([(w, dims) for w in ws])] == [box_sums(w, dims).raw for w in ws]
        True
    """
    out = [Sums() for _ in boxes]
    groups: dict[tuple[tuple[int, ...], tuple[tuple[int, int], ...], torch.dtype, torch.device], list[int]] = {}
    with torch.no_grad():
        for i, (view, dims) in enumerate(boxes):
            n = view.numel()
            if n == 0:
                continue
            if 4 * n > chunk or view.dim() == 0:
                _walk(view, _weights(tuple(dims), tuple(view.shape), view.device), 1, out[i], chunk)
            else:
                groups.setdefault((tuple(view.shape), tuple(dims), view.dtype, view.device), []).append(i)
        for (shape, dims, _, device), idx in groups.items():
            ws = _weights(dims, shape, device)
            per = max(1, chunk // math.prod(shape))
            for a in range(0, len(idx), per):
                part = idx[a : a + per]
                _read_batch([boxes[i][0] for i in part], ws, [out[i] for i in part])
    return out
