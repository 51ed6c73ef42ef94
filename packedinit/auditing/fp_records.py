"""What :func:`packedinit.fingerprint` returns: one record per logical block, the comparison, the JSON form."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from packedinit.errors import PackedInitError
from packedinit.shapes import fmt_shape

__all__ = ["FORMAT", "REL_TOL", "BlockRecord", "Fingerprint", "FingerprintDiff"]

#: The ``format`` field of :meth:`Fingerprint.to_json`.
FORMAT = "packedinit.fingerprint/1"
#: Relative tolerance (to the larger of |mean| and std) on mean and std when two records are compared:
#: float64 sums added in another order (another world size) round differently, by far less than this;
#: the hash and every other field compare exactly, and the hash is what tells two blocks' values apart.
REL_TOL = 1e-6


@dataclass(frozen=True)
class BlockRecord:
    """One logical block's fingerprint.

    Attributes:
        key: ``"param"`` for an unpacked parameter, ``"param[label]"`` for a block of a packed one.
        param: the parameter's name.
        block: the block's label (``"q"``, ``"part 1"``, ``"[3] gate"``), ``None`` for an unpacked parameter.
        shape: the logical shape, ``(out, in, *rest)``.
        dtype: the dtype, e.g. ``"float32"``.
        fan_in: ``torch.nn.init``'s fan_in of the logical shape (``None`` below 2 dims).
        fan_out: its fan_out.
        count: number of elements.
        mean: mean of the finite values (float64 sums); ``None`` without values (meta, complex).
        std: their population std.
        min: smallest finite value.
        max: largest finite value.
        non_finite: number of nan/inf values.
        hash: 64-bit hash of the logical block's values (16 hex digits), independent of storage,
            sharding and fusion; ``None`` without values.
    """

    key: str
    param: str
    block: str | None
    shape: tuple[int, ...]
    dtype: str
    fan_in: int | None
    fan_out: int | None
    count: int
    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    non_finite: int
    hash: str | None

    def differs(self, other: BlockRecord) -> bool:
        """Whether the two records describe different blocks (mean and std within :data:`REL_TOL`)."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("mean", "std") and a is not None and b is not None:
                scale = max(abs(self.mean or 0.0), self.std or 0.0, abs(other.mean or 0.0), other.std or 0.0)
                if not (a == b or abs(a - b) <= REL_TOL * scale):
                    return True
            elif f.name in ("key", "param", "block"):
                continue
            elif a != b and not (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
                return True
        return False

    def replace_field(self, name: str, value: Any) -> BlockRecord:
        """This record with one field replaced."""
        return replace(self, **{name: value})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        for k in ("mean", "std", "min", "max"):
            v = d[k]
            if v is not None and not math.isfinite(v):
                d[k] = repr(v)  # "inf", "-inf", "nan": JSON has no such numbers
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> BlockRecord:
        kw = dict(d)
        kw["shape"] = tuple(int(s) for s in kw["shape"])
        for k in ("mean", "std", "min", "max"):
            if isinstance(kw[k], str):
                kw[k] = float(kw[k])
        return BlockRecord(**kw)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


class FingerprintDiff(list[str]):
    """The keys whose records differ, in model order (a list: empty when the fingerprints match).

    ``str()`` names the first differing block, its hashes and its std ratio.
    """

    def __init__(self, keys: list[str], a: Fingerprint, b: Fingerprint) -> None:
        super().__init__(keys)
        self.a, self.b = a, b

    def report(self) -> str:
        """A few lines: how many blocks differ, the first one and what changed."""
        if not self:
            return f"fingerprints match: {len(self.a.blocks)} blocks, every hash equal"
        key = self[0]
        ra, rb = self.a.blocks.get(key), self.b.blocks.get(key)
        head = f"{len(self)} of {len(set(self.a.blocks) | set(self.b.blocks))} blocks differ; first: {key!r}"
        if ra is None or rb is None:
            return f"{head}: only in the {'second' if ra is None else 'first'} fingerprint"
        lines = [f"{head} {fmt_shape(ra.shape)}"]
        what = [f.name for f in fields(ra) if f.name not in ("key", "param", "block")]
        changed = [n for n in what if ra.replace_field(n, getattr(rb, n)).differs(ra)]
        lines.append("  changed: " + ", ".join(changed))
        lines.append(f"  hash {ra.hash} vs {rb.hash}; mean {_fmt(ra.mean)} vs {_fmt(rb.mean)}")
        if ra.std is not None and rb.std is not None:
            ratio = f" (ratio {rb.std / ra.std:.4f})" if ra.std else ""
            lines.append(f"  std {_fmt(ra.std)} vs {_fmt(rb.std)}{ratio}")
        if len(self) > 1:
            more = ", ".join(repr(k) for k in self[1:4])
            lines.append(f"  also: {more}{' ...' if len(self) > 4 else ''}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


@dataclass(frozen=True, eq=False)
class Fingerprint:
    """A model's (or a tensor's) init, block by block: see :func:`packedinit.fingerprint`.

    Attributes:
        blocks: ``{key: BlockRecord}`` in model order.
        model: the model's class name (reported only; not compared).
    """

    blocks: Mapping[str, BlockRecord]
    model: str = ""

    def __iter__(self) -> Iterator[str]:
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, key: str) -> BlockRecord:
        return self.blocks[key]

    def diff(self, other: Fingerprint) -> FingerprintDiff:
        """The keys whose records differ (present in one only, or any field changed), in model order."""
        if not isinstance(other, Fingerprint):
            raise PackedInitError(f"Fingerprint.diff needs a Fingerprint, got {type(other).__name__}.")
        keys = [k for k, r in self.blocks.items() if k not in other.blocks or r.differs(other.blocks[k])]
        keys += [k for k in other.blocks if k not in self.blocks]
        return FingerprintDiff(keys, self, other)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fingerprint) and not self.diff(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking mapping inside: compare, do not hash

    def to_json(self, indent: int | None = None) -> str:
        """The fingerprint as JSON (nan/inf as strings), read back exactly by :meth:`from_json`."""
        doc = {"format": FORMAT, "model": self.model, "blocks": [r.to_dict() for r in self.blocks.values()]}
        return json.dumps(doc, indent=indent, allow_nan=False)

    @staticmethod
    def from_json(text: str) -> Fingerprint:
        """The fingerprint :meth:`to_json` wrote."""
        try:
            doc = json.loads(text)
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
            records = [BlockRecord.from_dict(d) for d in doc["blocks"]]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise PackedInitError(
                f"Fingerprint.from_json: not a fingerprint written by Fingerprint.to_json ({e}); "
                f"expected a JSON object with format {FORMAT!r} and a list of blocks."
            ) from None
        return Fingerprint({r.key: r for r in records}, str(doc.get("model", "")))

    def __str__(self) -> str:
        head = ("block", "shape", "dtype", "mean", "std", "min", "max", "hash")
        rows = [
            (r.key, fmt_shape(r.shape), r.dtype, _fmt(r.mean), _fmt(r.std), _fmt(r.min), _fmt(r.max), r.hash or "-")
            + (() if not r.non_finite else (f"{r.non_finite} nan/inf",))
            for r in self.blocks.values()
        ]
        widths = [max([len(head[i])] + [len(r[i]) for r in rows]) for i in range(len(head))]
        lines = [f"fingerprint of {self.model or 'a tensor'}: {len(rows)} blocks"]
        for r in (head, *rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip())
            if len(r) > len(head):
                lines[-1] += "  " + r[-1]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Fingerprint({self.model or 'tensor'}: {len(self.blocks)} blocks)"
