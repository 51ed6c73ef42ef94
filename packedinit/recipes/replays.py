"""torch's default inits replayed through the engine, per block (bit-identical to torch's own).

Used by :func:`packedinit.recipes.reset.reset_parameters` for the modules whose class keeps
torch's method: MultiheadAttention, Transformer, Linear / conv, RNNs and cells, Embedding, and
transformers' default for ``nn.LSTM``.
"""


from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.init import (
    constant_,
    kaiming_uniform_,
    normal_,
    uniform_,
    xavier_normal_,
    xavier_uniform_,
)

from packedinit.adapters.torch_nn import QKV, gate_layout
from packedinit.engine.plan import Request
from packedinit.engine.run import run
from packedinit.engine.traits import is_dtensor
from packedinit.layout import Layout
from packedinit.model.walk import init_tree
from packedinit.torch_compat import (
    ConvNd,
    fill_padding_idx,
    is_lazy,
    mha_in_proj_packed,
    module_dict,
)

__all__ = [
    "own_tensors",
    "reset_multihead_attention",
    "reset_transformer",
    "with_global_params",
    "replay_for",
    "reset_hf_lstm",
]


def own_tensors(m: nn.Module) -> list[Tensor]:
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
    with_global_params(m, functools.partial(fill_padding_idx, m))


def with_global_params(m: nn.Module, step: Callable[[], None]) -> None:
    """Run a module's own init code; on DTensor parameters, on their global values.

    Torch's own init code writes through indexing (``weight[padding_idx].fill_(0)``) or
    draws per rank: on a sharded DTensor the first writes nothing and the second depends
    on the world size. Inside ``global_params`` every rank sees the global tensors and
    keeps its own shard of what was written.
    """
    if any(is_dtensor(t) for t in own_tensors(m)):
        from packedinit.engine.distributed import global_params

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


def replay_for(m: nn.Module) -> Callable[[Any, torch.Generator | None], None] | None:
    if is_lazy(m):
        return None
    own = getattr(type(m), "reset_parameters", None)
    for cls, replay in _REPLAYED:
        if isinstance(m, cls) and own is getattr(cls, "reset_parameters", None):
            return replay
    return None


def reset_hf_lstm(m: nn.LSTM, generator: torch.Generator | None) -> None:
    """transformers' default for ``nn.LSTM`` (xavier on every weight, zero biases), per gate."""
    kw: dict[str, Any] = {"generator": generator} if generator is not None else {}
    gates = gate_layout(m)
    for name, p in m.named_parameters():
        if "weight" in name:
            layout = gates if name.startswith(("weight_ih", "weight_hh")) else None
            run(Request(p, layout, None, xavier_uniform_, (), kw, name))
        elif "bias" in name:
            run(Request(p, None, None, constant_, (0.0,), {}, name))
