"""The LSTM/GRU recipe: :func:`init_recurrent_` (orthogonal recurrent weights, forget bias 1, per gate)."""


from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.init import (
    constant_,
    orthogonal_,
    xavier_uniform_,
    zeros_,
)

from packedinit.adapters.torch_nn import LSTM_GATES, gate_layout, gate_names
from packedinit.engine.plan import InitSpec, Request
from packedinit.errors import PackedInitError
from packedinit.layout import Layout
from packedinit.model.steps import plan_requests, run_steps
from packedinit.recipes.reset import check_generator

__all__ = ["init_recurrent_"]

M = TypeVar("M", bound=nn.Module)


# -- the recurrent recipe --------------------------------------------------------------------------
def init_recurrent_(
    module: M,
    input_init: InitSpec = xavier_uniform_,
    hidden_init: InitSpec = orthogonal_,
    forget_bias: float = 1.0,
    *,
    input_kwargs: Mapping[str, Any] | None = None,
    hidden_kwargs: Mapping[str, Any] | None = None,
    generator: torch.Generator | None = None,
    **init_kwargs: Any,
) -> M:
    r"""The usual LSTM/GRU init, per gate, for every layer and direction.

    For every ``nn.LSTM``/``nn.GRU``/``nn.RNN`` and ``LSTMCell``/``GRUCell``/``RNNCell``
    in ``module`` (itself included):

    - ``weight_ih*`` (G*H, I): ``input_init`` on each gate's (H, I) block;
    - ``weight_hh*`` (G*H, H): ``hidden_init`` on each gate's (H, H) block, so the
      default ``orthogonal_`` makes every gate's recurrent matrix orthogonal (on the
      packed (4H, H) tensor it would orthogonalise across gates instead);
    - ``weight_hr*`` (LSTM ``proj_size``): ``input_init`` on the whole matrix;
    - biases: zero, except the LSTM forget gate ``f`` of ``bias_ih*``, set to
      ``forget_bias`` (Gers et al. 2000; Jozefowicz et al. 2015).

    Why only one bias: an LSTM computes
    :math:`f_t = \sigma(W_{if} x_t + b_{if} + W_{hf} h_{t-1} + b_{hf})`; the two
    biases are summed, so the snippet that fills ``[H:2H]`` of every ``bias*``
    parameter gives an effective forget bias of 2, not 1. Here ``bias_ih`` holds
    ``forget_bias`` and ``bias_hh`` holds 0.

    GRU and plain RNN have no forget gate: their biases are all zero and
    ``forget_bias`` is not used. Gate names for per-gate specs: LSTM
    ``i, f, g, o``, GRU ``r, z, n``, RNN ``h``.

    Options of the init functions need no ``functools.partial``: other keywords
    (``gain=2.0``) go to both ``input_init`` and ``hidden_init``; ``input_kwargs`` /
    ``hidden_kwargs`` go to one side only and win over the shared ones. The names of
    this function's own keywords are never ones a ``torch.nn.init`` function takes
    (``generator`` means the same everywhere), so they cannot collide.

    Args:
        module: a recurrent module, or a model containing some.
        input_init: init fn for the input-to-hidden blocks; or per gate (a list, or
            a mapping by gate name).
        hidden_init: init fn for the hidden-to-hidden blocks; or per gate.
        forget_bias: the LSTM forget-gate bias (in ``bias_ih`` only).
        input_kwargs: keyword arguments for ``input_init`` only.
        hidden_kwargs: keyword arguments for ``hidden_init`` only.
        generator: used for every draw (the global RNG is then untouched).
        **init_kwargs: keyword arguments for both ``input_init`` and ``hidden_init``.

    Returns:
        ``module`` itself.

    Raises:
        PackedInitError: no recurrent module in ``module``, bad init specs, or an
            init fn rejecting a block; raised before anything is written.

    Examples:
        >>> lstm = init_recurrent_(torch.nn.LSTM(4, 8, num_layers=2, bidirectional=True))
        >>> H = 8
        >>> lstm.bias_ih_l1_reverse[H:2 * H].tolist() == [1.0] * H, bool(lstm.bias_hh_l1_reverse.eq(0).all())
        (True, True)
        >>> w = lstm.weight_hh_l0[2 * H:3 * H]  # the g gate's recurrent matrix
        >>> torch.allclose(w @ w.T, torch.eye(H), atol=1e-5)
        True
        >>> gru = init_recurrent_(torch.nn.GRU(4, 8), gain=2.0, input_kwargs={"gain": 1.0})
        >>> w = gru.weight_hh_l0[:H]  # r gate: orthogonal_ with gain 2
        >>> torch.allclose(w @ w.T, 4 * torch.eye(H), atol=1e-4)
        True
    """
    if not isinstance(module, nn.Module):
        raise PackedInitError(f"init_recurrent_(module) needs an nn.Module, got {type(module).__name__}.")
    for what, kw in (("input_kwargs", input_kwargs), ("hidden_kwargs", hidden_kwargs)):
        if kw is not None and (not isinstance(kw, Mapping) or not all(isinstance(k, str) for k in kw)):
            raise PackedInitError(f"init_recurrent_: {what} must be a mapping of keyword names, got {kw!r}.")
    if "generator" in (input_kwargs or {}) or "generator" in (hidden_kwargs or {}):
        raise PackedInitError("init_recurrent_: pass generator= once, as init_recurrent_(..., generator=g).")
    gen = check_generator(generator, "init_recurrent_")
    if isinstance(forget_bias, bool) or not isinstance(forget_bias, numbers.Real) or not math.isfinite(forget_bias):
        raise PackedInitError(f"init_recurrent_: forget_bias must be a finite number, got {forget_bias!r}.")
    gkw: dict[str, Any] = {"generator": gen} if gen is not None else {}
    ikw = {**init_kwargs, **(input_kwargs or {}), **gkw}
    hkw = {**init_kwargs, **(hidden_kwargs or {}), **gkw}
    jobs: list[tuple[str, Tensor, Layout | None, InitSpec, tuple[Any, ...], dict[str, Any]]] = []
    found = False
    for prefix, m in module.named_modules():
        if not isinstance(m, (nn.RNNBase, nn.RNNCellBase)):
            continue
        found = True
        gates = gate_layout(m)
        is_lstm = gate_names(m) == LSTM_GATES
        for n, p in m.named_parameters(recurse=False):
            fqn = f"{prefix}.{n}" if prefix else n
            if n.startswith("weight_ih"):
                jobs.append((fqn, p, gates, input_init, (), ikw))
            elif n.startswith("weight_hh"):
                jobs.append((fqn, p, gates, hidden_init, (), hkw))
            elif n.startswith("weight_hr"):
                if not callable(input_init):
                    raise PackedInitError(
                        f"init_recurrent_: {fqn!r} (proj_size projection, one matrix) needs one function, but "
                        f"input_init is per gate ({type(input_init).__name__}); pass a function."
                    )
                jobs.append((fqn, p, None, input_init, (), ikw))
            elif n.startswith("bias_ih") and is_lstm and gates is not None:
                fill = functools.partial(constant_, val=float(forget_bias))
                jobs.append((fqn, p, gates, {"i": zeros_, "f": fill, "g": zeros_, "o": zeros_}, (), {}))
            else:
                jobs.append((fqn, p, None, zeros_, (), {}))
    if not found:
        raise PackedInitError(
            f"init_recurrent_: {type(module).__name__} contains no LSTM/GRU/RNN or LSTMCell/GRUCell/RNNCell; "
            f"use packedinit.chunked(fn)(module) for other modules."
        )
    # validate everything first (all or nothing), then write
    run_steps(plan_requests(Request(p, layout, None, spec, args, kw, fqn) for fqn, p, layout, spec, args, kw in jobs))
    return module
