"""Packed tensors held under a parametrization: initialised as the weight, written through ``right_inverse``.

weight_norm keeps g and v, spectral_norm its power-iteration vectors: writing an original per
block would leave the others stale. :func:`through_parametrizations` and :func:`init_held`
initialise a stand-in of the weight per block and write it as ``module.weight = w`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

from torch import Tensor, nn

from packedinit.layout import Layout
from packedinit.model.marks import annotations_of
from packedinit.model.parametrized import (
    hook_v_g,
    is_holder,
    originals_of,
    renorm_hooked,
    stand_in,
    weight_norm_hooks,
    write_through,
)
from packedinit.model.steps import LeanStep, Step, plan_steps, run_steps

__all__ = ["Entry", "Swap", "through_parametrizations", "init_held", "write_entries"]

Entry: TypeAlias = tuple[str, Tensor, Layout | None]
#: A packed parametrized tensor: its ``ParametrizationList`` and the plain stand-in initialised per block.
Swap: TypeAlias = tuple[nn.Module, Tensor]


def through_parametrizations(
    modules: Iterable[nn.Module], entries: Sequence[Entry], init_fn: object
) -> tuple[list[Entry], list[Swap]]:
    """Entries in which each packed original of a parametrized tensor is replaced by a plain stand-in.

    The per-block init is meant for the tensor the module computes (``weight = g * v / ||v||``
    for ``weight_norm``), not for the original that holds the blocks: the stand-in, of the
    parametrized tensor's shape, is initialised per block, then written to the originals
    through ``right_inverse`` (:func:`packedinit.parametrized.write_through`: ``g = ||w||,
    v = w``; a ``spectral_norm``'s vectors are drawn again), as ``module.weight = w`` does.
    The other originals (``g``) are dropped: the plain loop on the unparametrised module
    never sees them, so the draws are those of that loop. An original annotated with a
    layout of its own shape, other than the tensor's, is initialised as it is.
    """
    modules = list(modules)
    holders = [m for m in modules if is_holder(m)]
    hooked = [m for m in modules if weight_norm_hooks(m)]
    if not holders and not hooked:
        return list(entries), []
    layout_of = {id(p): lay for _, p, lay in entries}
    swapped: dict[int, Tensor] = {}
    dropped: set[int] = set()
    swaps: list[Swap] = []
    for m in hooked:  # torch's old weight_norm hook: v per block, then g = ||v|| (what right_inverse does)
        for h in weight_norm_hooks(m):
            found = hook_v_g(m, h.name)
            if found is not None and layout_of.get(id(found[0])) is not None:
                dropped.add(id(found[1]))
                swaps.append((m, found[0]))
    for holder in holders:
        held = originals_of(holder)
        packed = [t for t in held if layout_of.get(id(t)) is not None]
        if len(packed) != 1:
            continue
        one = packed[0]
        lay = layout_of[id(one)]
        assert lay is not None  # packed: claimed with a layout
        if one.dim() - lay.batch_dims < 2:  # a packed 1-D tensor: skipped as any bias is
            continue
        name = next(n for n, p, _ in entries if p is one)
        standin = stand_in(holder, name, current=not callable(init_fn))
        if tuple(standin.shape) != tuple(one.shape):
            continue
        swapped[id(one)] = standin
        dropped.update(id(t) for t in held if t is not one)
        swaps.append((holder, standin))
    if not swaps:
        return list(entries), []
    out = [(n, swapped.get(id(p), p), lay) for n, p, lay in entries if id(p) not in dropped]
    return out, swaps


def write_entries(
    entries: Sequence[Entry],
    swaps: Sequence[Swap],
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> list[Step | LeanStep]:
    """Plan every entry (stand-ins included), write them, then write each stand-in through its parametrization.

    Returns the steps written (what :func:`packedinit.model.kept.keep_tree` may keep).
    """
    steps = plan_steps(entries, init_fn, args, kwargs)
    run_steps(steps)
    for holder, standin in swaps:
        if is_holder(holder):
            write_through(holder, standin)
        else:  # a weight_norm hook's v, written in place: its g follows
            renorm_hooked(holder, standin)
    return steps


def init_held(
    holder: nn.Module,
    p: Tensor,
    init_fn: Callable[..., Tensor],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    lays: Mapping[int, Layout | None] | None = None,
) -> bool:
    """``f(p)`` on an original of a packed ``ParametrizationList``: through the parametrization.

    The packed original: a stand-in of the parametrized tensor is initialised per block and
    written through ``right_inverse`` (see :func:`through_parametrizations`); a sibling of it
    (``weight_norm``'s ``g``) is left as it is (that write sets it). False: neither (``p`` is
    then initialised as it is). ``lays``: the originals' layouts by ``id``; default, the
    annotations on ``holder``.
    """
    anns = annotations_of(holder)
    prefix = type(holder).__name__
    entries = [(f"{prefix}.{n}", t, anns.get(n) if lays is None else lays.get(id(t))) for n, t in _leaves(holder)]
    out, swaps = through_parametrizations((holder,), entries, init_fn)
    if not swaps or any(t is p for _, t, _ in out):
        return False  # p is initialised as it is
    if any(t is p and lay is not None for _, t, lay in entries):  # the packed original: through the stand-in
        write_entries([e for e in out if e[1] is swaps[0][1]], swaps, init_fn, args, kwargs)
    return True  # else a sibling (g): the packed original's write sets it


def _leaves(holder: nn.Module) -> list[tuple[str, Tensor]]:
    """``(leaf name, original)`` of a ``ParametrizationList``."""
    held = originals_of(holder)
    if len(held) == 1:
        return [("original", held[0])]
    return [(f"original{i}", t) for i, t in enumerate(held)]
