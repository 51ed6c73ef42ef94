r"""One opt-in switch: torch's own construction initialises packed parameters per block.

:func:`fix_torch_defaults` replaces two torch methods, process-wide, until undone:

- ``nn.MultiheadAttention._reset_parameters`` (called by ``MultiheadAttention.__init__``,
  so also inside ``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer``,
  ``nn.Transformer`` and any library that builds an ``nn.MultiheadAttention``): the same
  steps as torch's, with ``xavier_uniform_`` run on each of the q, k, v blocks of
  ``in_proj_weight`` instead of the packed ``(3E, E)`` tensor (pytorch/pytorch#166378).
- ``nn.Transformer._reset_parameters``: ``xavier_uniform_`` on every parameter with
  ``dim > 1`` in torch's order, packed ones (those :func:`packedinit.layouts` knows)
  per block.

It also turns on :mod:`packedinit.recipes.init_calls`: every fan-dependent ``torch.nn.init``
function called (by torch, transformers' ``_init_weights``, other libraries, the user) on a
Parameter packedinit knows to be packed runs per block; every other call is torch's own.

Nothing else changes: same draws from the global RNG, in the same order, as torch's
methods, so every other parameter of a module built under the fix is bit-identical to
the one torch builds from the same seed.

The replaced methods run torch's own bodies, with the module's packed parameters known to
the init calls: the init functions those bodies call are looked up where torch bound them,
at call time, so a caller's guard is respected (transformers' ``guard_torch_init_functions``
skips what a load flagged ``_is_hf_initialized``; ``no_init_weights`` makes every call a
no-op): loading under the fix never changes a loaded value.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from types import TracebackType

import torch
from torch import nn

from packedinit.errors import PackedInitError
from packedinit.recipes import init_calls
from packedinit.torch_compat import RESET_METHOD

__all__ = ["TorchDefaultsFix", "fix_torch_defaults", "torch_defaults_fixed"]

_METHOD = RESET_METHOD

#: Guards ``_active`` and the install/restore of the class attributes.
_lock = threading.Lock()
#: How many handles are on (made and not yet undone); the methods are replaced while it is > 0.
_active = 0
#: The methods the fix replaced, per class: restored when the last handle is undone, and what a
#: subclass's own ``_reset_parameters`` gets when it calls ``super()._reset_parameters()``.
_saved: dict[type[nn.Module], Callable[[nn.Module], None]] = {}


def _through_bound_functions(m: nn.Module, cls: type[nn.Module]) -> None:
    """torch's own ``_reset_parameters`` of ``cls`` on ``m``, with ``m``'s packed parameters known to the init calls.

    torch's method calls the init functions bound in its own file (``torch.nn.modules.activation``,
    ``.transformer``) at call time, so whoever patched them is respected: transformers'
    ``guard_torch_init_functions`` skips the tensors a load flagged ``_is_hf_initialized``,
    ``no_init_weights`` makes every call a no-op. Where they are torch's, they are
    :mod:`~packedinit.recipes.init_calls`' wrappers (the fix holds the interception), and the
    wrappers run per block on the parameters of ``m`` known to be packed (``in_proj_weight``).
    """
    with init_calls.acquire(m):
        _saved[cls](m)


def _mha_reset_parameters(self: nn.MultiheadAttention) -> None:
    """``MultiheadAttention._reset_parameters``, replaced by ``packedinit.fix_torch_defaults()``: q, k, v per block."""
    if getattr(type(self), _METHOD) is _mha_reset_parameters:
        _through_bound_functions(self, nn.MultiheadAttention)
    else:  # reached through super() from a subclass's own method, written against torch's
        _saved[nn.MultiheadAttention](self)


def _transformer_reset_parameters(self: nn.Transformer) -> None:
    """``Transformer._reset_parameters``, replaced by ``packedinit.fix_torch_defaults()``: packed matrices per block."""
    if getattr(type(self), _METHOD) is _transformer_reset_parameters:
        _through_bound_functions(self, nn.Transformer)
    else:  # reached through super() from a subclass's own method, written against torch's
        _saved[nn.Transformer](self)


_TARGETS: tuple[tuple[type[nn.Module], Callable[..., None]], ...] = (
    (nn.MultiheadAttention, _mha_reset_parameters),
    (nn.Transformer, _transformer_reset_parameters),
)


def _install() -> None:
    missing = [cls.__qualname__ for cls, _ in _TARGETS if not callable(cls.__dict__.get(_METHOD))]
    if missing:
        raise PackedInitError(
            f"fix_torch_defaults(): this torch ({torch.__version__}) has no {_METHOD} method on "
            f"{', '.join(missing)}, so there is nothing to replace; initialise after construction instead: "
            f"packedinit.reset_parameters(model)."
        )
    for cls, fn in _TARGETS:
        current = cls.__dict__[_METHOD]
        if current is not fn:  # ours already when a restore was refused (see _restore)
            _saved[cls] = current
        setattr(cls, _METHOD, fn)


def _restore() -> None:
    for cls, fn in _TARGETS:
        current = cls.__dict__.get(_METHOD)
        if current is fn:
            setattr(cls, _METHOD, _saved[cls])
        else:
            warnings.warn(
                f"packedinit.fix_torch_defaults: {cls.__qualname__}.{_METHOD} was replaced by other code while "
                f"the fix was on (it is now {current!r}); left as that code set it, not restored to torch's.",
                RuntimeWarning,
                stacklevel=3,
            )


class TorchDefaultsFix:
    """The handle :func:`fix_torch_defaults` returns: one reference to the process-wide fix.

    Making one turns the fix on (if no other handle holds it); :meth:`undo` gives this
    handle's reference back, and the last one back restores torch's methods. Also a
    context manager: ``with fix_torch_defaults(): ...`` undoes on exit, whether the body
    returns or raises.
    """

    __slots__ = ("_calls", "_on")

    def __init__(self, *models: nn.Module) -> None:
        global _active
        self._on = False
        for m in models:
            if not isinstance(m, nn.Module):
                raise PackedInitError(f"fix_torch_defaults(*models) takes nn.Module instances, got {type(m).__name__}.")
        with _lock:
            if _active == 0:
                _install()
            try:
                self._calls = init_calls.acquire(*models)
            except BaseException:
                if _active == 0:
                    _restore()
                raise
            _active += 1
            self._on = True

    @property
    def active(self) -> bool:
        """Whether this handle still holds the fix (not yet undone)."""
        return self._on

    def undo(self) -> None:
        """Give this handle's reference back; torch's methods return when no handle holds the fix. Idempotent."""
        global _active
        with _lock:
            if not self._on:
                return
            self._on = False
            self._calls.release()
            _active -= 1
            if _active == 0:
                _restore()

    def __enter__(self) -> TorchDefaultsFix:
        if not self._on:
            raise PackedInitError(
                "fix_torch_defaults(): this handle was already undone, so entering it would not turn the fix on; "
                "make a new one: `with packedinit.fix_torch_defaults(): model = build()`."
            )
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"<packedinit.fix_torch_defaults handle: {'on' if self._on else 'undone'}>"


def fix_torch_defaults(*models: nn.Module) -> TorchDefaultsFix:
    r"""From this call on, torch's own construction initialises packed parameters per block.

    Replaces, for the whole process, ``nn.MultiheadAttention._reset_parameters`` (run
    by ``MultiheadAttention.__init__``, so also by every ``nn.TransformerEncoderLayer``,
    ``nn.TransformerDecoderLayer``, ``nn.Transformer`` and third-party model that builds
    one) and ``nn.Transformer._reset_parameters``:

    - ``MultiheadAttention``: ``xavier_uniform_`` on each q, k, v block of
      ``in_proj_weight`` (bound :math:`\sqrt{6/2E}`) instead of the packed ``(3E, E)``
      tensor (:math:`\sqrt{6/4E}`, pytorch/pytorch#166378); separate
      ``q/k/v_proj_weight`` (``kdim``/``vdim``), the biases (zero) and
      ``bias_k``/``bias_v`` (``xavier_normal_``) exactly as torch does.
    - ``Transformer``: ``xavier_uniform_`` on every parameter with ``dim > 1`` in
      ``parameters()`` order, as torch does, packed ones per block.
    - every fan-dependent ``torch.nn.init`` function (``xavier_*``, ``kaiming_*``,
      ``orthogonal_``, ``eye_``, ``dirac_``, ``sparse_``), whoever calls it (torch, a
      transformers ``_init_weights`` through ``transformers.initialization``, another
      library, you): on a Parameter known to be packed it runs once per block; on anything
      else it is torch's own call. Known to be packed: Parameters registered under the fix
      on a module with an adapter (MHA, LSTM/GRU/RNN and cells, registered adapters, also
      for an adapter's descendants), annotated Parameters, and the packed parameters of
      ``models``. Handed a tensor-parallel local shard (a DTensor parameter's
      ``_local_tensor`` / ``to_local()``, a Megatron-style shard), it uses the fans of the
      logical weight's blocks (:mod:`packedinit.model.shards`). Not reached: a function bound
      before the fix in a module packedinit does not know (``from torch.nn.init import
      xavier_uniform_``), a call on ``p.data`` (see :mod:`packedinit.recipes.init_calls` and
      the docs).

    The draws are torch's, in torch's order (tested on CPU, torch 2.13.0): every
    parameter other than the packed ones is bit-identical to torch's own construction
    from the same seed, and the
    packed ones hold torch's draws at the per-block bound. ``nn.MultiheadAttention``,
    ``nn.TransformerEncoderLayer``/``DecoderLayer`` (and an ``nn.Transformer`` with one
    layer of each) built under the fix are bit-identical to the same module built
    without it and then passed to :func:`packedinit.reset_parameters` from the same
    seed. Stacks of N > 1 layers differ from that: torch deep-copies one layer at
    construction, ``reset_parameters`` draws each layer on its own (see the docs).

    Scope and semantics:

    - **Modules built outside the fix** are untouched; modules built under it keep
      their values after it is undone. Only construction (and explicit calls of
      ``_reset_parameters``) is affected.
    - **Loading keeps loaded values** (``from_pretrained``, ``load_state_dict``,
      ``torch.load``, safetensors, accelerate's empty weights): torch's own bodies run
      through the init functions bound at call time, so transformers' guards
      (``_is_hf_initialized``, ``no_init_weights``) are respected.
    - **Subclasses** that define their own ``_reset_parameters`` are respected: theirs
      runs, and a ``super()._reset_parameters()`` call in it reaches torch's own method.
      Subclasses that do not define one get the per-block version.
    - **Reference counted**: each call returns a handle holding one reference; the
      methods are replaced while at least one handle is on, and torch's come back when
      the last is undone. Nested and overlapping uses are safe; ``undo()`` twice is
      harmless. Calling it without keeping the handle keeps the fix for the rest of
      the process.
    - **Process-wide, thread-safe bookkeeping**: the count is guarded by a lock, but
      the replaced methods are class attributes, so while any handle is on every
      thread's construction is fixed, not just the caller's.

    Args:
        *models: models built before the fix whose packed parameters (what
            :func:`packedinit.layouts` finds) the init calls should also know while this
            handle holds: ``with fix_torch_defaults(model): model.apply(model._init_weights)``.

    Returns:
        A :class:`TorchDefaultsFix`: ``.undo()`` turns this reference off; as a context
        manager it undoes on exit, also when the body raises.

    Raises:
        PackedInitError: the installed torch has no such method to replace (a future
            torch), or a model is not an ``nn.Module``; nothing was changed.

    Examples:
        >>> import torch
        >>> E = 32
        >>> with fix_torch_defaults():
        ...     mha = torch.nn.MultiheadAttention(E, 4)  # or any model that builds one
        >>> bool(mha.in_proj_weight.abs().max() <= (6 / (2 * E)) ** 0.5)  # per q/k/v block
        True
        >>> bool(mha.in_proj_weight.abs().max() > (6 / (4 * E)) ** 0.5)  # beyond torch's packed bound
        True
        >>> lstm = torch.nn.LSTM(8, 8)  # built before: handed to the fix, its init calls run per gate
        >>> with fix_torch_defaults(lstm):
        ...     _ = torch.nn.init.orthogonal_(lstm.weight_hh_l0)
        >>> g = lstm.weight_hh_l0.detach()[:8]
        >>> torch.allclose(g @ g.T, torch.eye(8), atol=1e-5)
        True
        >>> fix = fix_torch_defaults()  # or on until undone
        >>> layer = torch.nn.TransformerEncoderLayer(E, 4)
        >>> fix.undo()
        >>> torch_defaults_fixed()
        False
    """
    return TorchDefaultsFix(*models)


def torch_defaults_fixed() -> bool:
    """Whether :func:`fix_torch_defaults` is on in this process (some handle not yet undone).

    Examples:
        >>> with fix_torch_defaults():
        ...     torch_defaults_fixed()
        True
        >>> torch_defaults_fixed()
        False
    """
    return _active > 0
