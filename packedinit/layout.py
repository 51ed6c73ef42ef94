"""Layout: a pure description of how one tensor's storage holds logical blocks.

A :class:`Layout` never touches data. It validates itself, checks that it fits a
shape, and maps each logical block to a view of the storage. Everything that
reads or writes data (the engine, the audit, the distributed code) goes through
:meth:`Layout.blocks`, :meth:`Layout.storage_view` and :meth:`Layout.to_storage`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from packedinit.errors import PackedInitError
from packedinit.shapes import LogicalBlock, fans, fmt_shape, is_int, where_prefix
from packedinit.torch_compat import compile_safe_cache

# fmt_shape, fans, is_int and where_prefix are defined in packedinit.shapes (also importable from here).
__all__ = ["Layout", "LogicalBlock", "fmt_shape", "fans", "is_int", "where_prefix"]


class Layout:
    r"""How one packed dimension of a tensor holds several logical blocks.

    The packed dimension ``dim`` has length ``groups * sum(sizes)``: it is
    ``groups`` repetitions of the concatenation of parts of sizes
    ``sizes[0], sizes[1], ...``. Part ``j`` is the union over groups of its
    slice; its logical matrix has ``groups * sizes[j]`` rows in (group, row)
    order, which is how a model's forward sees that projection after its own
    ``view``/``split``. With ``transposed=True`` the storage is ``(in, out)``
    and every block is presented to init functions as ``(out, in)``. The first
    ``batch_dims`` dimensions index independent matrices (stacked experts or
    layers): each index is its own block and fans exclude them.

    A Layout is a frozen, hashable, picklable value; it only checks itself. Use
    :meth:`check` (or any init call) to check it against a shape, :meth:`blocks`
    for the logical blocks and their fans of a shape, and :meth:`describe` for the
    layout in words (``repr`` is the constructor call).

    Args:
        dim: the packed dimension (negative counts from the end).
        sizes: the size of each part within one group.
        groups: how many times the concatenation of parts repeats.
        transposed: storage is ``(in, out, ...)`` after the batch dims.
        batch_dims: number of leading dims that index independent blocks.
        names: optional names of the parts, e.g. ``("q", "k", "v")``.

    Examples:
        >>> E = 8
        >>> Layout(dim=0, sizes=[E, E, E], names=("q", "k", "v"))  # MHA in_proj_weight
        Layout(dim=0, sizes=(8, 8, 8), names=('q', 'k', 'v'))
        >>> Layout(dim=0, sizes=[4, 4, 4], groups=2)  # GPT-NeoX: q,k,v inside each head
        Layout(dim=0, sizes=(4, 4, 4), groups=2)
        >>> Layout(dim=2, sizes=[1, 1], groups=16, transposed=True, batch_dims=1)  # GPT-OSS experts
        Layout(dim=2, sizes=(1, 1), groups=16, transposed=True, batch_dims=1)
    """

    __slots__ = ("_batch_dims", "_dim", "_groups", "_hash", "_names", "_offsets", "_sizes", "_transposed")

    def __init__(
        self,
        dim: int = 0,
        sizes: Iterable[int] = (),
        groups: int = 1,
        transposed: bool = False,
        batch_dims: int = 0,
        names: Iterable[str] | None = None,
    ) -> None:
        def bad(msg: str) -> PackedInitError:
            return PackedInitError(f"Layout(dim={dim!r}, sizes={sizes!r}, groups={groups!r}, ...): {msg}")

        if not is_int(dim):
            raise bad("dim must be an int.")
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
            raise bad("sizes must be a sequence of positive ints, e.g. sizes=[E, E, E].")
        size_tuple = tuple(sizes)
        if not size_tuple:
            raise bad("sizes is empty; give at least one part size, e.g. sizes=[E, E, E].")
        for s in size_tuple:
            if not is_int(s) or operator.index(s) <= 0:
                raise bad(f"every size must be a positive int, got {s!r}; drop empty parts from sizes.")
        if not is_int(groups) or operator.index(groups) < 1:
            raise bad(f"groups must be a positive int, got {groups!r}.")
        if not isinstance(transposed, bool):
            raise bad(f"transposed must be a bool, got {transposed!r}.")
        if not is_int(batch_dims) or operator.index(batch_dims) < 0:
            raise bad(f"batch_dims must be a non-negative int, got {batch_dims!r}.")
        name_tuple: tuple[str, ...] | None = None
        if names is not None:
            if isinstance(names, str):
                raise bad(f"names must be a sequence of strings, e.g. ('q', 'k', 'v'), not the string {names!r}.")
            name_tuple = tuple(names)
            if len(name_tuple) != len(size_tuple):
                raise bad(
                    f"{len(name_tuple)} names {name_tuple!r} for {len(size_tuple)} sizes; give one name per part."
                )
            for n in name_tuple:
                if not isinstance(n, str) or not n:
                    raise bad(f"every name must be a non-empty string, got {n!r}.")
            if len(set(name_tuple)) != len(name_tuple):
                raise bad(f"names {name_tuple!r} repeat; part names must be unique.")
        self._dim = operator.index(dim)
        self._sizes = tuple(operator.index(s) for s in size_tuple)
        self._groups = operator.index(groups)
        self._transposed = transposed
        self._batch_dims = operator.index(batch_dims)
        self._names = name_tuple
        offsets, at = [], 0
        for s in self._sizes:  # where each part starts within a group: planning stays linear in parts
            offsets.append(at)
            at += s
        self._offsets = tuple(offsets)
        self._hash = hash(self._key())

    # -- value semantics -------------------------------------------------------------------
    @property
    def dim(self) -> int:
        """The packed dimension, as given (may be negative)."""
        return self._dim

    @property
    def sizes(self) -> tuple[int, ...]:
        """Size of each part within one group."""
        return self._sizes

    @property
    def groups(self) -> int:
        """How many times the concatenation of parts repeats along ``dim``."""
        return self._groups

    @property
    def transposed(self) -> bool:
        """Whether storage is ``(in, out, ...)`` (after the batch dims)."""
        return self._transposed

    @property
    def batch_dims(self) -> int:
        """Number of leading dims whose every index is an independent block."""
        return self._batch_dims

    @property
    def names(self) -> tuple[str, ...] | None:
        """Names of the parts, or ``None``."""
        return self._names

    @property
    def packed_size(self) -> int:
        """Length the packed dim must have: ``groups * sum(sizes)``."""
        return self._groups * (self._offsets[-1] + self._sizes[-1])

    @property
    def num_parts(self) -> int:
        """Number of parts (``len(sizes)``)."""
        return len(self._sizes)

    def offset(self, part: int) -> int:
        """Where part ``part`` (an index) starts within one group: ``sum(sizes[:part])``, precomputed.

        Examples:
            >>> Layout(0, [4, 2, 2]).offset(2)
            6
        """
        return self._offsets[part]

    def _key(self) -> tuple[object, ...]:
        return (self._dim, self._sizes, self._groups, self._transposed, self._batch_dims, self._names)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return self._hash

    def __setattr__(self, name: str, value: object) -> None:
        if hasattr(self, "_hash"):
            raise AttributeError("Layout is immutable; build a new one with Layout(...)")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Layout is immutable; build a new one with Layout(...)")

    def __copy__(self) -> Layout:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Layout:
        return self

    def __reduce__(self) -> tuple[object, ...]:
        return (Layout, (self._dim, self._sizes, self._groups, self._transposed, self._batch_dims, self._names))

    def __repr__(self) -> str:
        parts = [f"dim={self._dim}", f"sizes={self._sizes}"]
        if self._groups != 1:
            parts.append(f"groups={self._groups}")
        if self._transposed:
            parts.append("transposed=True")
        if self._batch_dims:
            parts.append(f"batch_dims={self._batch_dims}")
        if self._names is not None:
            parts.append(f"names={self._names}")
        return "Layout(" + ", ".join(parts) + ")"

    def describe(self) -> str:
        """The layout in words: which blocks the packed dim holds and how init functions see them.

        Examples:
            >>> print(Layout(dim=0, sizes=[8, 8, 8], names=("q", "k", "v")).describe())
            dim 0 = [q:8 | k:8 | v:8]: 3 blocks (q, k, v), each presented to init functions on its own
            >>> print(Layout(dim=2, sizes=[1, 1], groups=16, transposed=True, batch_dims=1).describe())
            dim 2 = 16 x [part0:1 | part1:1]: 2 blocks interleaved in 16 groups; block j is the union of its
            16 slices (16*size rows, in (group, row) order), stored (in, out) and presented as (out, in);
            each index of dim 0 (a batch dim) holds its own set of blocks
        """
        names = self._names or tuple(f"part{j}" for j in range(self.num_parts))
        cat = " | ".join(f"{n}:{s}" for n, s in zip(names, self._sizes, strict=False))
        n = self.num_parts
        what = f"{n} block" + ("s" if n != 1 else "")
        if self._names:
            what += " (" + ", ".join(self._names) + ")"
        if self._groups != 1:
            text = (
                f"dim {self._dim} = {self._groups} x [{cat}]: {what} interleaved in {self._groups} groups; "
                f"block j is the union of its {self._groups} slices ({self._groups}*size rows, in (group, row) order)"
            )
        else:
            text = f"dim {self._dim} = [{cat}]: {what}"
        if self._transposed:
            text += ", stored (in, out) and presented as (out, in)"
        if self._batch_dims:
            k = self._batch_dims
            dims = "dim 0 (a batch dim)" if k == 1 else f"dims 0..{k - 1} (batch dims)"
            text += f"; each index of {dims} holds its own set of blocks"
        else:
            text += ", each presented to init functions on its own"
        return text

    def part_index(self, part: int | str) -> int:
        """The index of a part given by index or by name."""
        if isinstance(part, str):
            if self._names is None or part not in self._names:
                known = list(self._names) if self._names else "none (this layout has no names)"
                raise PackedInitError(f"{self!r} has no part named {part!r}; known names: {known}.")
            return self._names.index(part)
        if not is_int(part) or not -self.num_parts <= int(part) < self.num_parts:
            raise PackedInitError(f"{self!r} has no part {part!r}; parts are 0..{self.num_parts - 1}.")
        return int(part) % self.num_parts

    # -- binding to a shape ----------------------------------------------------------------
    def normalized_dim(self, ndim: int) -> int:
        """``dim`` as a non-negative index for a tensor of ``ndim`` dims (unchecked)."""
        return self._dim + ndim if self._dim < 0 else self._dim

    def check(self, shape: Sequence[int], *, param: str | None = None) -> None:
        """Raise :class:`PackedInitError` unless this layout fits ``shape``.

        Args:
            shape: the stored shape of the tensor.
            param: the parameter's name, used in the message.
        """
        _check(self, tuple(int(s) for s in shape), param)

    def blocks(self, shape: Sequence[int], *, param: str | None = None) -> tuple[LogicalBlock, ...]:
        """The logical blocks of a tensor of ``shape``, in block order.

        Block order is batch index major (row-major over the batch dims), then part.
        """
        return _blocks(self, tuple(int(s) for s in shape), param)

    def storage_view(self, tensor: Tensor, block: LogicalBlock) -> Tensor:
        """A view (never a copy) of ``block``'s elements in ``tensor``'s storage order.

        Its shape is the stored shape without the batch dims, with the packed dim
        unflattened to ``(groups, sizes[part])``.
        """
        d = self.normalized_dim(tensor.dim())
        v = tensor
        for i in block.batch_index:
            v = v[i]
        d -= self._batch_dims
        v = _split_dim(v, d, self._groups, self._offsets[-1] + self._sizes[-1])
        return v.narrow(d + 1, self._offsets[block.part], self._sizes[block.part])

    def to_storage(self, logical: Tensor, block: LogicalBlock, ndim: int) -> Tensor:
        """Map a tensor of ``block.shape`` to the shape of :meth:`storage_view` (a view).

        Args:
            logical: a tensor of the block's logical shape.
            block: the block.
            ndim: number of dims of the stored (packed) tensor.
        """
        v = logical.transpose(0, 1) if self._transposed else logical
        d = self.normalized_dim(ndim) - self._batch_dims
        return _split_dim(v, d, self._groups, self._sizes[block.part])

    def logical_view(self, tensor: Tensor, block: LogicalBlock) -> Tensor | None:
        """The block as a view of logical shape, or ``None`` when no view exists."""
        s = self.storage_view(tensor, block)
        d = self.normalized_dim(tensor.dim()) - self._batch_dims
        if self._groups != 1:
            try:
                merged = s.view(*s.shape[:d], s.shape[d] * s.shape[d + 1], *s.shape[d + 2 :])
            except RuntimeError:
                return None
        else:
            merged = s.squeeze(d)
        return merged.transpose(0, 1) if self._transposed else merged


def _split_dim(t: Tensor, d: int, a: int, b: int) -> Tensor:
    """View dim ``d`` of length ``a * b`` as two dims ``(a, b)`` (always a view)."""
    shape = list(t.shape)
    return t.view(*shape[:d], a, b, *shape[d + 1 :])


@compile_safe_cache(maxsize=4096)
def _check(layout: Layout, shape: tuple[int, ...], param: str | None) -> None:
    ndim = len(shape)
    where = f"{where_prefix(param)}of shape {fmt_shape(shape)} with {layout!r}"
    if ndim == 0:
        raise PackedInitError(f"{where}: a 0-D tensor has no dim to pack; pass a tensor with at least 1 dim.")
    if layout.batch_dims >= ndim:
        raise PackedInitError(
            f"{where}: batch_dims={layout.batch_dims} leaves no dims for the matrix; use batch_dims < {ndim}."
        )
    if not -ndim <= layout.dim < ndim:
        raise PackedInitError(
            f"{where}: dim {layout.dim} is out of range for a {ndim}-D tensor; use a dim in [{-ndim}, {ndim - 1}]."
        )
    d = layout.normalized_dim(ndim)
    if d < layout.batch_dims:
        raise PackedInitError(
            f"{where}: the packed dim {d} is one of the {layout.batch_dims} batch dims; "
            f"pack a dim >= {layout.batch_dims} or lower batch_dims."
        )
    if shape[d] != layout.packed_size:
        g = f"{layout.groups} x " if layout.groups != 1 else ""
        raise PackedInitError(
            f"{where}: dim {d} has length {shape[d]} but the layout needs "
            f"{g}sum{list(layout.sizes)} = {layout.packed_size}; fix sizes/groups or dim."
        )
    if layout.transposed and ndim - layout.batch_dims < 2:
        raise PackedInitError(
            f"{where}: transposed=True needs at least 2 dims after the batch dims; "
            f"use transposed=False for a {ndim - layout.batch_dims}-D block."
        )


@compile_safe_cache(maxsize=4096)
def _blocks(layout: Layout, shape: tuple[int, ...], param: str | None) -> tuple[LogicalBlock, ...]:
    _check(layout, shape, param)
    ndim = len(shape)
    d = layout.normalized_dim(ndim) - layout.batch_dims
    batch_shape = shape[: layout.batch_dims]
    inner = list(shape[layout.batch_dims :])
    out: list[LogicalBlock] = []
    batch_indices: list[tuple[int, ...]] = [()]
    for n in batch_shape:
        batch_indices = [(*b, i) for b in batch_indices for i in range(n)]
    for b in batch_indices:
        for j, size in enumerate(layout.sizes):
            lshape = list(inner)
            lshape[d] = layout.groups * size
            if layout.transposed:
                lshape[0], lshape[1] = lshape[1], lshape[0]
            fan_in, fan_out = fans(lshape)
            out.append(
                LogicalBlock(
                    index=len(out),
                    batch_index=b,
                    part=j,
                    name=layout.names[j] if layout.names else None,
                    shape=torch.Size(lshape),
                    fan_in=fan_in,
                    fan_out=fan_out,
                )
            )
    return tuple(out)
