"""Recipes: torch's default init done per block (``reset_parameters``) and the LSTM/GRU recipe.

``reset_parameters`` re-runs every submodule's own default init, packed blocks on their
own; ``init_recurrent_`` is the usual recurrent init (orthogonal recurrent, forget bias).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor, nn

from packedinit.engine.rng import generator_as_default
from packedinit.engine.traits import is_dtensor
from packedinit.errors import PackedInitError
from packedinit.model.parametrized import check_writable, is_parametrized, run_unparametrized
from packedinit.model.ties import later_holders, without_later_ties
from packedinit.recipes import init_calls
from packedinit.recipes.coverage import (
    dry_run,
    globalize,
    hf_flags_cleared,
    hf_owners,
    meta_stand_ins,
    retie,
    tensor_holders,
    uncovered_message,
)
from packedinit.recipes.model_init import EntryPoint, ModelInit, entry_points
from packedinit.recipes.replays import (
    own_tensors,
    replay_for,
    reset_hf_lstm,
    reset_multihead_attention,
    reset_transformer,
    with_global_params,
)
from packedinit.torch_compat import (
    RESET_METHOD,
    private_reset,
)

__all__ = ["reset_parameters", "reset_keeping", "check_generator"]

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


def check_generator(generator: object, where: str) -> torch.Generator | None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise PackedInitError(f"{where}: generator must be a torch.Generator, got {type(generator).__name__}.")
    return generator


@dataclass
class _Step:
    """One init step of ``reset_parameters``: what it runs and which tensors it fills."""

    module: nn.Module
    run: Callable[[], None]
    route: bool  # run with the generator routed through the default CPU RNG
    covers: Sequence[Tensor] | None  # None: found by a dry run on meta stand-ins
    globalize: bool = False  # DTensor parameters it writes become global-shape tensors meanwhile
    entry: str | None = None  # the model's own init entry point it runs (named in errors)


def _hf_init(owner: nn.Module, m: nn.Module) -> None:
    """The model's own ``_init_weights(m)``: what ``post_init`` runs on every submodule."""
    init_weights = getattr(owner, "_init_weights")  # noqa: B009  # transformers' method, named as it is
    with torch.no_grad():
        init_weights(m)


def _default_step(m: nn.Module, gen: torch.Generator | None) -> _Step | None:
    """Torch's own default init of ``m`` (the one construction ran), or None when it has none."""
    replay = replay_for(m)
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
            _check_routable(m, gen, own_tensors(m))
        return _Step(m, functools.partial(with_global_params, m, private_reset(m)), gen is not None, covers)
    if replay is not None:
        return _Step(m, functools.partial(replay, m, gen), False, list(m.parameters(recurse=False)))
    reset = getattr(m, "reset_parameters", None)
    if callable(reset):
        if gen is not None:
            _check_routable(m, gen, own_tensors(m))
        return _Step(m, functools.partial(with_global_params, m, reset), gen is not None, None)
    return None


def _entry_step(e: EntryPoint, gen: torch.Generator | None) -> _Step:
    if gen is not None:
        _check_routable(e.module, gen, [*e.module.parameters(), *e.module.buffers()])
    return _Step(e.module, functools.partial(_no_grad, e.run), gen is not None, None, entry=e.name)


def _no_grad(run: Callable[[], object]) -> None:
    with torch.no_grad():  # as the libraries' own flows call it
        run()


def _plan(module: nn.Module, gen: torch.Generator | None, entries: Sequence[EntryPoint] = ()) -> list[_Step]:
    owners = hf_owners(module)
    by_module: dict[int, list[EntryPoint]] = {}
    for e in entries:
        by_module.setdefault(id(e.module), []).append(e)
    steps: list[_Step] = []
    for m in _post_order(module):
        owner = owners.get(id(m))
        if owner is not None and isinstance(m, nn.LSTM) and replay_for(m) is not None:
            steps.append(_Step(m, functools.partial(reset_hf_lstm, m, gen), False, list(m.parameters())))
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
        steps += [_entry_step(e, gen) for e in by_module.get(id(m), ())]  # after its subtree, as constructed
    return steps


def _dry_run_all(module: nn.Module, steps: list[_Step]) -> list[_Step]:
    """Fill in what each third-party step writes; drop a torch default that the model's own init overwrites."""
    with meta_stand_ins(module) as stand_ins, hf_flags_cleared(module):
        for step in steps:
            if step.covers is None:
                written = dry_run(step.run, stand_ins)
                if written is None and step.entry is not None:
                    raise PackedInitError(
                        f"reset_parameters({type(module).__name__}): the model's own init, {step.entry}, fails on "
                        f"meta stand-ins of its tensors, so what it writes cannot be checked before writing; nothing "
                        f"was written. Fix: pass model_init= a function that initialises the model (it runs after "
                        f"torch's defaults), or model_init='' to run torch's defaults only and fill the rest yourself."
                    )
                # init code that fails on meta tensors: trust the convention (a module initialises its own tensors)
                step.covers = written if written is not None else stand_ins.originals(own_tensors(step.module))
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


def reset_parameters(
    module: nn.Module,
    *,
    generator: torch.Generator | None = None,
    strict: bool = True,
    model_init: ModelInit = None,
) -> None:
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
    - the model library's own init entry point, after torch's defaults of its module's
      subtree (where construction ran it): timm's ``init_weights()``, torchtitan's
      ``init_states(buffer_device=None)`` (its ``init_weights``), open_clip's
      ``init_parameters()``, x-transformers' ``init_()``; found by class path
      (:mod:`packedinit.recipes.model_init`), or the one ``model_init=`` names. One that
      fails on meta stand-ins, or a timm model whose blocks' init scheme is not kept
      (maxxvit), is refused by name before any write; what it leaves unwritten is named
      as below.
    - while any of these runs, every fan-dependent ``torch.nn.init`` call it makes on a
      packed parameter of ``module`` runs per block (:mod:`packedinit.recipes.init_calls`): the
      model's own init (SigLIP's pooling head, Mask2Former), with its packed blocks per block.
    - a parametrized module (``weight_norm``, ``spectral_norm``, ``orthogonal``):
      its own init on a plain stand-in of the unparametrised weight, the originals
      written through ``right_inverse`` (see :mod:`packedinit.model.parametrized`).
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
        model_init: the model's own init entry point, run after torch's defaults: a
            method name of ``module`` (``"init_weights"``), a function of ``module``, or
            ``""`` for none. ``None`` (the default) finds the libraries' entry points.

    Raises:
        PackedInitError: ``generator`` is not a Generator, or cannot be routed
            through some module's own init; a parameter or buffer no known init
            covers (``strict=True``); a ``model_init`` method ``module`` lacks, or an
            entry point that fails on meta stand-ins. Raised before any write.

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
        >>> class Gated(torch.nn.Module):  # its own init, called by its constructor
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.mha = torch.nn.MultiheadAttention(E, 4)
        ...         self.gate = torch.nn.Parameter(torch.empty(E))
        ...         self.init_weights()
        ...     def init_weights(self) -> None:
        ...         torch.nn.init.zeros_(self.gate)
        ...         torch.nn.init.xavier_normal_(self.mha.in_proj_weight)  # runs per q, k, v block
        >>> with torch.device("meta"):
        ...     model = Gated()
        >>> model = model.to_empty(device="cpu")
        >>> reset_parameters(model, model_init="init_weights")
        >>> float(model.gate.detach().abs().sum())
        0.0
        >>> round(float(model.mha.in_proj_weight.detach().std()), 1)  # xavier per (E, E) block: sqrt(2 / 2E) = 0.18
        0.2
    """
    if not isinstance(module, nn.Module):
        raise PackedInitError(f"reset_parameters(module) needs an nn.Module, got {type(module).__name__}.")
    reset_keeping(module, generator=generator, strict=strict, model_init=model_init, forward="reset_parameters(model)")


def reset_keeping(
    module: nn.Module,
    *,
    generator: torch.Generator | None = None,
    strict: bool = True,
    keep: Collection[Tensor] = (),
    filled: Collection[Tensor] = (),
    check_only: bool = False,
    model_init: ModelInit = None,
    forward: str | None = None,
) -> None:
    """:func:`reset_parameters`, leaving the tensors in ``keep`` as they are and counting ``filled`` as covered.

    ``keep``: tensors whose values must stay (parts of a model built outside
    :func:`packedinit.deferred`): the init steps that write only them are skipped; a step that
    would write one of them together with others is refused before any write.
    ``filled``: tensors the caller fills afterwards (the recorded construction calls), so
    they are no "uncovered" error. ``check_only``: every check, no write.
    """
    gen = check_generator(generator, "reset_parameters")
    retie(module)
    kept = {id(t) for t in keep}
    entries = entry_points(module, model_init, filled={id(t) for t in filled})
    steps = _dry_run_all(module, _plan(module, gen, entries))
    if kept:
        steps = _without_kept(module, steps, kept)
    covered = {id(t) for step in steps for t in (step.covers or ())} | kept | {id(t) for t in filled}
    message = uncovered_message(module, covered)
    if message is not None and entries:
        ran = ", ".join(e.name for e in entries)
        message += f" The model's own init ran on meta stand-ins ({ran}) and writes none of them."
    if message is not None:
        if strict:
            raise PackedInitError(message)
        warnings.warn(message.replace(" or pass strict=False to initialise everything else and", " or"), stacklevel=3)
    if check_only:
        return
    holders = tensor_holders(module)
    later = later_holders(module)  # a tie's later holder (nanoGPT's lm_head) did not init the shared tensor
    # the model's own init calls: packed ones per block
    with hf_flags_cleared(module), init_calls.acquire(module, forward=forward):
        for step in steps:
            with contextlib.ExitStack() as stack:
                if step.globalize:
                    globalize(stack, [t for t in (step.covers or ()) if is_dtensor(t)], holders)
                else:
                    stack.enter_context(without_later_ties(step.module, later))
                if step.route and gen is not None:
                    stack.enter_context(generator_as_default(gen))  # under packedinit.engine.rng.LOCK
                step.run()


def _without_kept(module: nn.Module, steps: list[_Step], kept: set[int]) -> list[_Step]:
    """The steps that write no kept tensor; one that writes kept and other tensors is refused."""
    names = {id(t): n for n, t in (*module.named_parameters(), *module.named_buffers())}
    out: list[_Step] = []
    for step in steps:
        covers = list(step.covers or ())
        hit = [t for t in covers if id(t) in kept]
        if not hit:
            out.append(step)
        elif len(hit) < len(covers):
            ours = [names.get(id(t), "?") for t in hit]
            theirs = [names.get(id(t), "?") for t in covers if id(t) not in kept]
            raise PackedInitError(
                f"materialize({type(module).__name__}): the init of {type(step.module).__name__} writes "
                f"{', '.join(map(repr, ours))} (built outside packedinit.deferred(), with values to keep) together "
                f"with {', '.join(map(repr, theirs))} (built inside, on meta); running it would overwrite the "
                f"former, so nothing was written. Fix: build that module wholly inside the deferred() block, or "
                f"wholly outside it."
            )
    return out


def _check_routable(m: nn.Module, gen: torch.Generator, tensors: list[Tensor]) -> None:
    bad = [t for t in tensors if t.device.type not in ("cpu", "meta")]
    if gen.device.type != "cpu" or bad:
        where = bad[0].device if bad else gen.device
        raise PackedInitError(
            f"reset_parameters(generator=...): {type(m).__name__}'s own init takes no generator, and "
            f"packedinit can route only a CPU generator to CPU parameters through it (found {where}); "
            f"seed the default RNG instead (torch.manual_seed) and pass generator=None."
        )
