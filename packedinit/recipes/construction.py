"""Construction-time init outside init methods, recorded on meta and replayed after ``to_empty``.

x-transformers' token embedding runs ``nn.init.kaiming_normal_(self.emb.weight)`` in its
``__init__``: on the meta device that call does nothing, and ``reset_parameters`` can only
run ``nn.Embedding``'s default (``normal_(0, 1)``, not std 0.18). :func:`deferred` builds
on the meta device and records every ``torch.nn.init`` call that construction makes outside
an init method; :meth:`Deferred.replay` runs them again, in order, on the materialised
tensors, packed parameters per block.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from packedinit.engine.plan import Request
from packedinit.engine.run import run
from packedinit.engine.traits import TORCH_INIT  # torch's own functions, also while fix_torch_defaults() replaces them
from packedinit.errors import PackedInitError
from packedinit.model.claims import layouts
from packedinit.model.ties import to_empty
from packedinit.recipes.coverage import storage_key
from packedinit.recipes.model_init import ModelInit, in_entry_point
from packedinit.recipes.reset import reset_keeping
from packedinit.torch_compat import RESET_METHOD, TorchDispatchMode, caller_frame, written_args

__all__ = ["Deferred", "deferred"]

#: Frames whose init calls ``reset_parameters`` already replays: torch's init methods and transformers'
#: ``post_init`` chain (a plain model's own ``self.apply(self._init_weights)`` in ``__init__`` is recorded).
#: The registration of a parametrization is one too: torch's own ``set_`` on the original, written through
#: ``right_inverse`` by ``reset_parameters``.
_INIT_METHODS = frozenset(
    {
        "reset_parameters",
        RESET_METHOD,
        "_initialize_weights",
        "initialize_weights",
        "post_init",
        "register_parametrization",
    }
)


@dataclass
class Deferred:
    """The init calls a construction on meta made outside init methods: ``(storage key, function, kwargs)``."""

    calls: list[tuple[int, Any, dict[str, Any]]] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    #: storage key -> the ops that wrote it in place outside torch.nn.init and init methods (cannot be replayed)
    other_writes: dict[int, set[str]] = field(default_factory=dict)
    #: the recorded calls on tensors that are no parameter or buffer of the bound model (a scratch tensor,
    #: a sub-module replaced later): dead writes, not replayed (``"xavier_uniform_ on a (3, 3) tensor"``)
    dead: list[str] = field(default_factory=list)
    #: the meta tensors recorded, kept alive so that no later tensor reuses their storage key
    held: list[Tensor] = field(default_factory=list, repr=False)
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)
    bound: bool = False

    def bind(self, model: nn.Module) -> None:
        """Name the recorded tensors by the model's parameter and buffer names (while it is still on meta:
        :meth:`materialize` does it before ``to_empty``); the calls on other tensors are dead writes."""
        for n, t in (*model.named_parameters(), *model.named_buffers()):
            self.names.setdefault(storage_key(t), n)
        self.dead = [
            f"{getattr(fn, '__name__', fn)} on a {self.shapes.get(key, ())} tensor"
            for key, fn, _ in self.calls
            if key not in self.names
        ]
        self.bound = True

    def materialize(
        self, model: nn.Module, *, device: torch.device | str | int | None, model_init: ModelInit = None
    ) -> list[str]:
        """``to_empty`` (ties kept), ``reset_parameters``, then :meth:`replay`; the names the replay wrote.

        ``model_init`` is :func:`packedinit.reset_parameters`'s: the model's own init entry point
        (found by class path when None). Calls construction made inside a known entry point are
        not recorded: ``reset_parameters`` runs the entry point itself.

        Parameters and buffers that are not on meta (parts built outside the block) keep their
        values: their own init is not run, and the values are copied onto ``device``. Every check
        (what no init covers, an init that would write both kept and new tensors) runs first.
        """
        self.bind(model)
        before = dict((*model.named_parameters(), *model.named_buffers()))
        kept_names = [n for n, t in before.items() if not t.is_meta]
        filled = {self.names[key] for key, _, _ in self.calls if key in self.names}
        reset_keeping(
            model,
            keep=[before[n] for n in kept_names],
            filled=[t for n, t in before.items() if n in filled],
            check_only=True,
            model_init=model_init,
        )
        self._check_names(before)
        with torch.no_grad():
            values = {n: before[n].detach() for n in kept_names}
            del before
            to_empty(model, device=device)
            after = dict((*model.named_parameters(), *model.named_buffers()))
            for n, value in values.items():
                after[n].copy_(value)
        reset_keeping(
            model,
            keep=[after[n] for n in kept_names],
            filled=[t for n, t in after.items() if n in filled],
            model_init=model_init,
        )
        return self.replay(model)

    def _check_names(self, by_name: dict[str, Tensor]) -> None:
        if not self.bound:
            raise PackedInitError(
                "deferred().replay: the recorded calls are not bound to the model's names; call "
                "construction.bind(model) while the model is still on meta, or use construction.materialize(model, "
                "device=...), which binds, materialises and replays."
            )
        bound = [(self.names.get(key), fn) for key, fn, _ in self.calls]
        lost = [getattr(fn, "__name__", fn) for name, fn in bound if name is not None and name not in by_name]
        if lost:
            raise PackedInitError(
                f"deferred().replay: {len(lost)} init call(s) made during construction ({', '.join(map(str, lost))}) "
                f"wrote tensors that were bound to names the model no longer has; nothing was written. Fix: replay "
                f"on the model the construction built, before replacing its parts."
            )

    def replay(self, model: nn.Module) -> list[str]:
        """Run the recorded calls again on ``model``'s tensors, in order, packed ones per block; the names written.

        Call it after :meth:`bind` (on meta), ``to_empty`` and ``reset_parameters`` (which fills
        everything else). Calls on tensors that were no parameter or buffer at :meth:`bind` (a
        scratch tensor, a sub-module replaced later) are dead writes: listed in :attr:`dead`,
        not replayed.

        Raises:
            PackedInitError: not bound, or a recorded call's tensor is no longer a parameter
                or buffer of ``model`` (nothing is written then).
        """
        by_name = dict((*model.named_parameters(), *model.named_buffers()))
        self._check_names(by_name)
        unreplayable = {self.names[k]: ops for k, ops in self.other_writes.items() if self.names.get(k) in by_name}
        if unreplayable:
            warnings.warn(
                f"deferred: construction wrote {len(unreplayable)} tensor(s) in place outside torch.nn.init and "
                f"init methods, which cannot be replayed: "
                + ", ".join(f"{n!r} ({', '.join(sorted(ops))})" for n, ops in unreplayable.items())
                + "; they hold what reset_parameters and the recorded init calls give instead. Fix: move those "
                "writes into the module's reset_parameters() method.",
                stacklevel=2,
            )
        known = layouts(model)
        done: list[str] = []
        for key, fn, kwargs in self.calls:
            name = self.names.get(key)
            if name is None:
                continue  # a dead write (see bind)
            run(Request(by_name[name], known.get(name), None, fn, (), dict(kwargs), name))
            done.append(name)
        return done


@contextlib.contextmanager
def deferred() -> Iterator[Deferred]:
    """Build on the meta device, recording the init calls construction makes outside init methods.

    Examples:
        >>> class Tok(torch.nn.Module):  # x-transformers style: init in __init__, no reset method
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.emb = torch.nn.Embedding(1000, 64)
        ...         torch.nn.init.kaiming_normal_(self.emb.weight)
        >>> import packedinit
        >>> with deferred() as construction:
        ...     tok = Tok()
        >>> construction.materialize(tok, device="cpu")  # to_empty, reset_parameters, then the recorded calls
        ['emb.weight']
        >>> round(float(tok.emb.weight.detach().std()), 2)  # kaiming_normal_: sqrt(2 / 64)
        0.18
    """
    found = Deferred()
    codes = {
        f.__code__: f
        for name, f in vars(TORCH_INIT).items()
        if isinstance(f, types.FunctionType) and name.endswith("_") and not name.startswith("_")
    }
    depth = [0]
    before = sys.getprofile()

    def hook(frame: types.FrameType, event: Any, arg: object) -> object:
        if frame.f_code in codes:
            if event == "call":
                depth[0] += 1
                t = frame.f_locals.get("tensor")
                if depth[0] == 1 and isinstance(t, Tensor) and t.is_meta and not _inside_init_method(frame):
                    fn = codes[frame.f_code]
                    kwargs = {k: v for k, v in frame.f_locals.items() if k != "tensor"}
                    key = storage_key(t)
                    found.calls.append((key, fn, kwargs))
                    found.held.append(t)
                    found.shapes[key] = tuple(t.shape)
            elif event == "return":
                depth[0] -= 1
        if before is not None:
            before(frame, event, arg)
        return None

    sys.setprofile(hook)
    try:
        with torch.device("meta"), _OtherWrites(found.other_writes, depth, found.held):
            yield found
    finally:
        sys.setprofile(before)


class _OtherWrites(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves __init_subclass__ untyped
    """Records in-place writes to meta tensors made outside init functions and init methods."""

    def __init__(self, into: dict[int, set[str]], depth: list[int], held: list[Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves __init__ untyped
        self.into = into
        self.depth = depth
        self.held = held

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.depth[0] == 0:
            for value in written_args(func, args, kwargs):
                if isinstance(value, Tensor) and value.is_meta and not _inside_init_method(caller_frame()):
                    self.into.setdefault(storage_key(value), set()).add(str(func.overloadpacket.__name__))
                    self.held.append(value)  # no later tensor reuses its key
        return func(*args, **kwargs)


def _inside_init_method(frame: types.FrameType) -> bool:
    f = frame.f_back
    while f is not None:
        if f.f_code.co_name in _INIT_METHODS:
            return True
        f = f.f_back
    return in_entry_point(frame.f_back)  # a library's own init entry point: reset_parameters runs it
