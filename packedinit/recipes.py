"""Recipes: torch's default init done per block (``reset_parameters``) and the LSTM/GRU recipe.

``reset_parameters`` re-runs every submodule's own default init, packed blocks on their
own; ``init_recurrent_`` is the usual recurrent init (orthogonal recurrent, forget bias).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.init import (
    constant_,
    kaiming_uniform_,
    normal_,
    orthogonal_,
    uniform_,
    xavier_normal_,
    xavier_uniform_,
    zeros_,
)

from . import init_calls
from .adapters.torch_nn import LSTM_GATES, QKV, gate_layout, gate_names
from .errors import PackedInitError
from .layout import Layout
from .materialize import (
    dry_run,
    globalize,
    hf_flags_cleared,
    hf_owners,
    meta_stand_ins,
    retie,
    tensor_holders,
    uncovered_message,
)
from .parametrized import check_writable, is_parametrized, run_unparametrized
from .plan import InitSpec, Request
from .rng import generator_as_default
from .run import run
from .ties import later_holders, without_later_ties
from .torch_compat import (
    RESET_METHOD,
    ConvNd,
    fill_padding_idx,
    is_lazy,
    mha_in_proj_packed,
    module_dict,
    private_reset,
)
from .traits import is_dtensor
from .walk import init_tree, plan_requests, run_steps

__all__ = ["reset_parameters", "init_recurrent_"]

M = TypeVar("M", bound=nn.Module)


# -- default init, per block -----------------------------------------------------------------------
def _post_order(module: nn.Module) -> list[nn.Module]:
    """Every distinct submodule, children before parents (the order torch constructs them in)."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append(m)

    visit(module)
    return out


def _check_generator(generator: object, where: str) -> torch.Generator | None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise PackedInitError(f"{where}: generator must be a torch.Generator, got {type(generator).__name__}.")
    return generator


def _own_tensors(m: nn.Module) -> list[Tensor]:
    """``m``'s own parameters and buffers, the originals of its parametrized tensors included."""
    held = module_dict(m).get("parametrizations")
    extra = [*held.parameters(), *held.buffers()] if isinstance(held, nn.ModuleDict) else []
    return [*m.parameters(recurse=False), *m.buffers(recurse=False), *extra]


def reset_multihead_attention(m: nn.MultiheadAttention, generator: torch.Generator | None = None) -> None:
    """``MultiheadAttention._reset_parameters`` with xavier per q/k/v block (pytorch/pytorch#166378).

    Same draws in the same order as torch's method; only the bound of ``in_proj_weight`` changes.
    """
    kw: dict[str, Any] = {"generator": generator} if generator is not None else {}
    if mha_in_proj_packed(m):
        if m.in_proj_weight is not None:
            layout = Layout(0, (m.embed_dim,) * 3, names=QKV)
            run(Request(m.in_proj_weight, layout, None, xavier_uniform_, (), kw, "in_proj_weight"))
    else:
        for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            run(Request(getattr(m, name), None, None, xavier_uniform_, (), kw, name))
    if m.in_proj_bias is not None:
        run(Request(m.in_proj_bias, None, None, constant_, (0.0,), {}, "in_proj_bias"))
        if m.out_proj.bias is not None:
            run(Request(m.out_proj.bias, None, None, constant_, (0.0,), {}, "out_proj.bias"))
    for name in ("bias_k", "bias_v"):
        t = getattr(m, name)
        if t is not None:
            run(Request(t, None, None, xavier_normal_, (), kw, name))


def reset_transformer(m: nn.Module, generator: torch.Generator | None = None) -> None:
    """``nn.Transformer._reset_parameters``: ``xavier_uniform_`` on every ``dim > 1`` parameter, packed ones per block.

    Parameters in ``m.parameters()`` order (torch's order), blocks in block order, one RNG stream.
    """
    kw: dict[str, Any] = {"generator": generator} if generator is not None else {}
    init_tree(m, xavier_uniform_, (), kw)


def _reset_linear_or_conv(m: nn.Linear | ConvNd, generator: torch.Generator | None) -> None:
    """``Linear.reset_parameters`` / ``_ConvNd.reset_parameters``, through the engine (generator, DTensor)."""
    kw: dict[str, Any] = {"generator": generator} if generator is not None else {}
    w = m.weight
    run(Request(w, None, None, kaiming_uniform_, (), {"a": math.sqrt(5), **kw}, "weight"))
    b = m.bias
    if b is not None:
        fan_in = w.shape[1] * math.prod(w.shape[2:]) if w.dim() >= 2 else 0
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        run(Request(b, None, None, uniform_, (-bound, bound), kw, "bias"))


def _reset_recurrent(m: nn.RNNBase | nn.RNNCellBase, generator: torch.Generator | None) -> None:
    """``RNNBase.reset_parameters`` / ``RNNCellBase.reset_parameters``: U(+-1/sqrt(H)) on everything."""
    kw: dict[str, Any] = {"generator": generator} if generator is not None else {}
    h = m.hidden_size
    stdv = 1.0 / math.sqrt(h) if h > 0 else 0
    for name, p in m.named_parameters():
        run(Request(p, None, None, uniform_, (-stdv, stdv), kw, name))


def _reset_embedding(m: nn.Embedding, generator: torch.Generator | None) -> None:
    kw: dict[str, Any] = {"generator": generator} if generator is not None else {}
    run(Request(m.weight, None, None, normal_, (), kw, "weight"))
    _with_global_params(m, functools.partial(fill_padding_idx, m))


def _with_global_params(m: nn.Module, step: Callable[[], None]) -> None:
    """Run a module's own init code; on DTensor parameters, on their global values.

    Torch's own init code writes through indexing (``weight[padding_idx].fill_(0)``) or
    draws per rank: on a sharded DTensor the first writes nothing and the second depends
    on the world size. Inside ``global_params`` every rank sees the global tensors and
    keeps its own shard of what was written.
    """
    if any(is_dtensor(t) for t in _own_tensors(m)):
        from .distributed import global_params

        with global_params(m):
            step()
    else:
        step()


#: Torch defaults packedinit replays itself (bit-identical), so that ``generator=`` and
#: DTensor parameters go through the engine; used only where the class keeps that method.
_REPLAYED: tuple[tuple[type[nn.Module], Callable[[Any, torch.Generator | None], None]], ...] = (
    (nn.Linear, _reset_linear_or_conv),
    (ConvNd, _reset_linear_or_conv),
    (nn.RNNBase, _reset_recurrent),
    (nn.RNNCellBase, _reset_recurrent),
    (nn.Embedding, _reset_embedding),
)


def _replay_for(m: nn.Module) -> Callable[[Any, torch.Generator | None], None] | None:
    if is_lazy(m):
        return None
    own = getattr(type(m), "reset_parameters", None)
    for cls, replay in _REPLAYED:
        if isinstance(m, cls) and own is getattr(cls, "reset_parameters", None):
            return replay
    return None


@dataclass
class _Step:
    """One init step of ``reset_parameters``: what it runs and which tensors it fills."""

    module: nn.Module
    run: Callable[[], None]
    route: bool  # run with the generator routed through the default CPU RNG
    covers: Sequence[Tensor] | None  # None: found by a dry run on meta stand-ins
    globalize: bool = False  # DTensor parameters it writes become global-shape tensors meanwhile


def _reset_hf_lstm(m: nn.LSTM, generator: torch.Generator | None) -> None:
    """transformers' default for ``nn.LSTM`` (xavier on every weight, zero biases), per gate."""
    kw: dict[str, Any] = {"generator": generator} if generator is not None else {}
    gates = gate_layout(m)
    for name, p in m.named_parameters():
        if "weight" in name:
            layout = gates if name.startswith(("weight_ih", "weight_hh")) else None
            run(Request(p, layout, None, xavier_uniform_, (), kw, name))
        elif "bias" in name:
            run(Request(p, None, None, constant_, (0.0,), {}, name))


def _hf_init(owner: nn.Module, m: nn.Module) -> None:
    """The model's own ``_init_weights(m)``: what ``post_init`` runs on every submodule."""
    init_weights = getattr(owner, "_init_weights")  # noqa: B009  # transformers' method, named as it is
    with torch.no_grad():
        init_weights(m)


def _default_step(m: nn.Module, gen: torch.Generator | None) -> _Step | None:
    """Torch's own default init of ``m`` (the one construction ran), or None when it has none."""
    replay = _replay_for(m)
    for base in (nn.MultiheadAttention, nn.Transformer):
        if not isinstance(m, base):
            continue
        covers = [p for p in m.parameters() if p.dim() > 1] if base is nn.Transformer else None
        if getattr(type(m), RESET_METHOD, None) is getattr(base, RESET_METHOD, None):
            # torch's default (or fix_torch_defaults'): per block
            if isinstance(m, nn.MultiheadAttention):
                return _Step(m, functools.partial(reset_multihead_attention, m, gen), False, list(m.parameters(False)))
            return _Step(m, functools.partial(reset_transformer, m, gen), False, covers)
        if gen is not None:  # a subclass's own default init is respected, as construction ran it
            _check_routable(m, gen, _own_tensors(m))
        return _Step(m, functools.partial(_with_global_params, m, private_reset(m)), gen is not None, covers)
    if replay is not None:
        return _Step(m, functools.partial(replay, m, gen), False, list(m.parameters(recurse=False)))
    reset = getattr(m, "reset_parameters", None)
    if callable(reset):
        if gen is not None:
            _check_routable(m, gen, _own_tensors(m))
        return _Step(m, functools.partial(_with_global_params, m, reset), gen is not None, None)
    return None


def _plan(module: nn.Module, gen: torch.Generator | None) -> list[_Step]:
    owners = hf_owners(module)
    steps: list[_Step] = []
    for m in _post_order(module):
        owner = owners.get(id(m))
        if owner is not None and isinstance(m, nn.LSTM) and _replay_for(m) is not None:
            steps.append(_Step(m, functools.partial(_reset_hf_lstm, m, gen), False, list(m.parameters())))
            continue
        default = _default_step(m, gen)
        if default is not None and is_parametrized(m):  # construction ran it before the parametrization came
            check_writable(m)
            run_plain = functools.partial(run_unparametrized, m, default.run)
            default = _Step(m, run_plain, default.route, None, default.globalize)
        if default is not None:
            steps.append(default)
        if owner is not None and not isinstance(m, nn.MultiheadAttention):  # MHA: torch's own init, per block
            if gen is not None:
                _check_routable(m, gen, [*m.parameters(), *m.buffers()])
            steps.append(_Step(m, functools.partial(_hf_init, owner, m), gen is not None, None, globalize=True))
    return steps


def _dry_run_all(module: nn.Module, steps: list[_Step]) -> list[_Step]:
    """Fill in what each third-party step writes; drop a torch default that the model's own init overwrites."""
    with meta_stand_ins(module) as stand_ins, hf_flags_cleared(module):
        for step in steps:
            if step.covers is None:
                written = dry_run(step.run, stand_ins)
                # init code that fails on meta tensors: trust the convention (a module initialises its own tensors)
                step.covers = written if written is not None else stand_ins.originals(_own_tensors(step.module))
    kept: list[_Step] = []
    for i, step in enumerate(steps):
        later = steps[i + 1] if i + 1 < len(steps) else None
        if later is not None and later.globalize and later.module is step.module and not step.globalize:
            assert step.covers is not None
            assert later.covers is not None
            overwritten = {id(t) for t in later.covers}
            if all(id(t) in overwritten for t in step.covers):
                continue  # construction ran it, then post_init overwrote all of it: the result is the same
        kept.append(step)
    return kept


def reset_parameters(module: nn.Module, *, generator: torch.Generator | None = None, strict: bool = True) -> None:
    r"""Initialise every parameter as construction did, with packed blocks initialised on their own.

    The call that materialises a model built on the meta device
    (``meta -> [fully_shard] -> to_empty -> reset_parameters``), and a re-init of any
    model. Visits every distinct submodule children first (the order torch constructs
    them in) and re-runs its own default init:

    - ``nn.MultiheadAttention``: torch's ``_reset_parameters`` with ``xavier_uniform_``
      per q, k, v block of ``in_proj_weight``. This is the fix proposed in
      pytorch/pytorch#166378: torch draws the packed (3E, E) tensor from
      :math:`\mathcal{U}(\pm\sqrt{6/4E})` instead of :math:`\mathcal{U}(\pm\sqrt{6/2E})`.
      The result is bit-identical (same seed) to ``xavier_uniform_`` on separate
      q, k, v tensors; ``in_proj_bias`` and ``out_proj.bias`` are zeroed and
      ``bias_k``/``bias_v`` get ``xavier_normal_``, as torch does.
    - ``nn.Transformer``: ``xavier_uniform_`` on every parameter with ``dim > 1``,
      as its ``_reset_parameters`` does, packed ones per block.
    - ``Linear``, ``Conv*``, ``Embedding``, ``LSTM``/``GRU``/``RNN`` and their cells
      (unless a subclass overrides ``reset_parameters``): torch's default replayed
      call for call through packedinit's engine, bit-identical to torch, so that
      ``generator=`` and DTensor parameters are honoured.
    - any other module with a ``reset_parameters()`` method (``LayerNorm``,
      ``BatchNorm*``, your own modules): that method.
    - inside a transformers ``PreTrainedModel``: after the above, the model's own
      ``_init_weights(module)`` on every submodule, as ``post_init`` does (so
      ``normal(0, initializer_range)``, GPT-2's scaled ``c_proj``, norms, rotary
      ``inv_freq`` hold); a nested ``PreTrainedModel`` uses its own. Its
      ``nn.MultiheadAttention`` and ``nn.LSTM`` defaults are run per block. Tied
      weights are tied again first (``tie_weights()``): ``to_empty`` unties them.
    - while any of these runs, every fan-dependent ``torch.nn.init`` call it makes on a
      packed parameter of ``module`` runs per block (:mod:`packedinit.init_calls`): the
      model's own init (SigLIP's pooling head, Mask2Former), with its packed blocks per block.
    - a parametrized module (``weight_norm``, ``spectral_norm``, ``orthogonal``):
      its own init on a plain stand-in of the unparametrised weight, the originals
      written through ``right_inverse`` (see :mod:`packedinit.parametrized`).
    - a Parameter several modules share (``lm_head.weight = wte.weight``): initialised
      by its first holder; a later holder's init draws into scratch, as construction did
      before the tie (use :func:`packedinit.to_empty` to keep plain ties).

    What each third-party init writes is found first, by running it on meta
    stand-ins of the tensors (no memory, no random numbers; the ``torch.nn.init``
    functions that return early on meta, and tensors assigned anew, count). A parameter or buffer
    that nothing writes (a custom module with a parameter and no
    ``reset_parameters``) is named in a ``PackedInitError`` before anything is
    written; with ``strict=False`` it is named in one warning and left as it is.
    Init code that fails on meta tensors is trusted to fill its module's own tensors.

    Clones stay independent: the layers of a ``TransformerEncoder`` (deep copies of
    one layer at construction) each get their own draws.

    Args:
        module: the model (or a single module).
        generator: draw every random number from it (the global RNG is then
            untouched). Modules whose ``reset_parameters()`` takes no generator
            run with the default CPU RNG temporarily set to ``generator``'s state,
            which needs a CPU generator and CPU (or meta) parameters.
        strict: raise (the default) or only warn when some parameter or buffer is
            covered by no known init.

    Raises:
        PackedInitError: ``generator`` is not a Generator, or cannot be routed
            through some module's own init; a parameter or buffer no known init
            covers (``strict=True``). Raised before any write.

    Examples:
        >>> E = 32
        >>> mha = torch.nn.MultiheadAttention(E, 4)
        >>> reset_parameters(mha, generator=torch.Generator().manual_seed(0))
        >>> bool(mha.in_proj_weight.abs().max() <= (6 / (2 * E)) ** 0.5)
        True
        >>> bool(mha.in_proj_weight.abs().max() > (6 / (4 * E)) ** 0.5)  # torch's packed bound
        True
        >>> class Scale(torch.nn.Module):  # a parameter and no reset_parameters
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.gain = torch.nn.Parameter(torch.ones(3))
        >>> reset_parameters(torch.nn.Sequential(torch.nn.Linear(3, 3), Scale()))
        Traceback (most recent call last):
        ...
        packedinit.errors.PackedInitError: reset_parameters(Sequential): no known init covers 1 parameter(s) ...
    """
    if not isinstance(module, nn.Module):
        raise PackedInitError(f"reset_parameters(module) needs an nn.Module, got {type(module).__name__}.")
    gen = _check_generator(generator, "reset_parameters")
    retie(module)
    steps = _dry_run_all(module, _plan(module, gen))
    covered = {id(t) for step in steps for t in (step.covers or ())}
    message = uncovered_message(module, covered)
    if message is not None:
        if strict:
            raise PackedInitError(message)
        warnings.warn(message.replace(" or pass strict=False to initialise everything else and", " or"), stacklevel=2)
    holders = tensor_holders(module)
    later = later_holders(module)  # a tie's later holder (nanoGPT's lm_head) did not init the shared tensor
    with hf_flags_cleared(module), init_calls.acquire(module):  # the model's own init calls: packed ones per block
        for step in steps:
            with contextlib.ExitStack() as stack:
                if step.globalize:
                    globalize(stack, [t for t in (step.covers or ()) if is_dtensor(t)], holders)
                else:
                    stack.enter_context(without_later_ties(step.module, later))
                if step.route and gen is not None:
                    stack.enter_context(generator_as_default(gen))  # under packedinit.rng.LOCK
                step.run()


def _check_routable(m: nn.Module, gen: torch.Generator, tensors: list[Tensor]) -> None:
    bad = [t for t in tensors if t.device.type not in ("cpu", "meta")]
    if gen.device.type != "cpu" or bad:
        where = bad[0].device if bad else gen.device
        raise PackedInitError(
            f"reset_parameters(generator=...): {type(m).__name__}'s own init takes no generator, and "
            f"packedinit can route only a CPU generator to CPU parameters through it (found {where}); "
            f"seed the default RNG instead (torch.manual_seed) and pass generator=None."
        )


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
    gen = _check_generator(generator, "init_recurrent_")
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
