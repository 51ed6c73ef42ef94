"""The one exception type packedinit raises for bad input."""

from __future__ import annotations

__all__ = [
    "PackedInitError",
    "LayoutWarning",
    "packed_error",
    "PackedInitTypeError",
    "PackedInitRuntimeError",
    "PackedInitNotImplementedError",
]


class PackedInitError(ValueError):
    """Raised for input packedinit cannot handle correctly.

    It is a :class:`ValueError`. Where packedinit raises it in place of an error that
    torch itself raised (a ``TypeError`` for a bad argument type, a ``RuntimeError`` from
    a kernel, a ``NotImplementedError`` for a dtype), the exception is also an instance
    of that torch error's type, so ``except RuntimeError:`` code written around
    ``torch.nn.init`` keeps working. The message names the parameter (when known), its
    shape, the layout and the fix. packedinit raises it before it writes anything: the
    tensor is left bit-identical to what it was (with an unpacked tensor and your own
    init function, as that function left it).

    Examples:
        >>> import torch
        >>> from packedinit import PackedInitError, chunked_init
        >>> w = torch.zeros(10, 4)
        >>> try:
        ...     chunked_init(w, 3, 0, torch.nn.init.xavier_uniform_)
        ... except PackedInitError as e:
        ...     print(e)
        tensor of shape (10, 4): dim 0 has length 10, which 3 equal chunks cannot divide; pass sizes instead, ...
        >>> bool((w == 0).all())
        True
        >>> try:  # torch raises TypeError for a gain that is not a number: so does packedinit
        ...     chunked_init(torch.empty(6, 2), 3, 0, torch.nn.init.orthogonal_, gain="relu")
        ... except TypeError as e:
        ...     print(type(e).__name__, isinstance(e, PackedInitError))
        PackedInitTypeError True
    """


class PackedInitTypeError(PackedInitError, TypeError):
    """A :class:`PackedInitError` that is also a :class:`TypeError`: a bad argument type or keyword.

    Raised where torch raises ``TypeError`` (a gain that is not a number), for a keyword
    neither packedinit nor the init function takes, and for arguments in another call's order.

    Examples:
        >>> import torch
        >>> from packedinit import PackedInitTypeError, chunked_init
        >>> try:
        ...     chunked_init(torch.nn.init.xavier_uniform_, torch.empty(6, 2), 3, 0)
        ... except PackedInitTypeError as e:
        ...     print(isinstance(e, TypeError), isinstance(e, ValueError))
        True True
    """


class PackedInitRuntimeError(PackedInitError, RuntimeError):
    """A :class:`PackedInitError` that is also a :class:`RuntimeError` (in place of a torch kernel's error).

    Examples:
        >>> issubclass(PackedInitRuntimeError, RuntimeError), issubclass(PackedInitRuntimeError, PackedInitError)
        (True, True)
    """


class PackedInitNotImplementedError(PackedInitError, NotImplementedError):
    """A :class:`PackedInitError` that is also a :class:`NotImplementedError` (a dtype a torch kernel lacks).

    Examples:
        >>> issubclass(PackedInitNotImplementedError, RuntimeError)
        True
    """


_SUBCLASSES: dict[type[BaseException], type[PackedInitError]] = {
    TypeError: PackedInitTypeError,
    RuntimeError: PackedInitRuntimeError,
    NotImplementedError: PackedInitNotImplementedError,
}


def _subclass(cls: type[BaseException]) -> type[PackedInitError]:
    """``PackedInit<Name>``: a subclass of both PackedInitError and ``cls`` (or PackedInitError alone)."""
    got = _SUBCLASSES.get(cls)
    if got is not None:
        return got
    if issubclass(PackedInitError, cls):
        return PackedInitError
    name = f"PackedInit{cls.__name__}"
    try:
        sub = type(name, (PackedInitError, cls), {"__module__": __name__, "__qualname__": name})
    except TypeError:  # an exception type whose layout cannot be combined with ValueError's
        return PackedInitError
    globals().setdefault(name, sub)  # picklable by name when the name is free
    return _SUBCLASSES.setdefault(cls, sub)


def packed_error(message: str, like: BaseException | None = None) -> PackedInitError:
    """A PackedInitError with ``message`` that is also an instance of ``type(like)`` when that is an Exception.

    For packedinit's own checks (``like=None``) it is a plain PackedInitError; in place
    of an error torch raised, it keeps that error's type too (``TypeError``,
    ``RuntimeError``, ``NotImplementedError``, ...), so existing handlers keep catching it.

    Examples:
        >>> e = packed_error("tensor of shape (3,): bad", RuntimeError("kernel failed"))
        >>> isinstance(e, RuntimeError), isinstance(e, PackedInitError), isinstance(e, ValueError)
        (True, True, True)
    """
    if like is None or isinstance(like, PackedInitError) or not isinstance(like, Exception):
        return PackedInitError(message)
    return _subclass(type(like))(message)


class LayoutWarning(UserWarning):
    """Warned where packedinit cannot be sure a weight is initialised per block.

    The whole-model idioms (``chunked(f)(model)``, ``model.apply(chunked(f))``,
    :func:`packedinit.init_model`, :func:`packedinit.reset_parameters`) warn with it when a
    weight looks packed (a fused name, a stack of matrices) and no adapter, annotation or
    trace of the forward gives its layout, and when an adapter and the forward disagree. The
    message names every such weight and gives the ``packedinit.annotate(model, ...)`` line
    that fixes it. Strict mode is Python's own: ``warnings.simplefilter("error", LayoutWarning)``
    makes each of them an exception, raised before anything is written.

    Examples:
        >>> import warnings
        >>> issubclass(LayoutWarning, UserWarning)
        True
    """
