"""torch.nn's packed modules: their adapters, their default init done per block, and an RNN recipe.

Packed parameters in torch.nn (torch 2.5 - 2.13), all packed along dim 0:

| module | packed parameters | blocks |
|---|---|---|
| ``MultiheadAttention`` | ``in_proj_weight`` (3E, E) when kdim = vdim = E; ``in_proj_bias`` (3E,) | ``q, k, v`` |
| ``LSTM`` / ``LSTMCell`` | ``weight_ih*``, ``weight_hh*``, ``bias_ih*``, ``bias_hh*`` | gates ``i, f, g, o`` |
| ``GRU`` / ``GRUCell`` | ``weight_ih*``, ``weight_hh*``, ``bias_ih*``, ``bias_hh*`` | gates ``r, z, n`` |
| ``RNN`` / ``RNNCell`` | nothing: one gate, each weight is one block | |

Not packed: MHA's ``q/k/v_proj_weight`` (the kdim/vdim path), ``bias_k``, ``bias_v``,
``out_proj``; an LSTM's ``weight_hr*`` (``proj_size``). ``Transformer`` and
``TransformerEncoderLayer``/``TransformerDecoderLayer`` hold their packed weights in
``MultiheadAttention`` children, so they need no adapter of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from torch import nn

from packedinit.errors import PackedInitError
from packedinit.layout import Layout
from packedinit.model.parametrized import weight_norm_hooks
from packedinit.model.registry import Adapter
from packedinit.torch_compat import mha_in_proj_packed, module_dict, param_dict, rnn_weight_names

__all__ = [
    "ADAPTERS",
    "multihead_attention_layouts",
    "rnn_layouts",
    "rnn_cell_layouts",
    "gate_names",
    "gate_layout",
]

M = TypeVar("M", bound=nn.Module)

QKV = ("q", "k", "v")
LSTM_GATES = ("i", "f", "g", "o")
GRU_GATES = ("r", "z", "n")
#: The one "gate" of a plain RNN, so that per-gate recipes name it too.
RNN_GATES = ("h",)


def _expect(module: nn.Module, cls: type[M], adapter: str) -> M:
    if not isinstance(module, cls):
        raise PackedInitError(
            f"{adapter} describes {cls.__name__} modules but was called on a {type(module).__name__}; "
            f"register it only for {cls.__name__} (or subclasses)."
        )
    return module


def multihead_attention_layouts(module: nn.Module) -> dict[str, Layout]:
    """Adapter for ``nn.MultiheadAttention``: ``[q | k | v]`` along dim 0.

    ``in_proj_weight`` (3E, E) is packed only when ``kdim == vdim == embed_dim``
    (otherwise it is ``None`` and ``q_proj_weight``, ``k_proj_weight``,
    ``v_proj_weight`` are separate). ``in_proj_bias`` (3E,) is packed in both cases.
    The forward (``F._in_projection_packed`` / ``F._in_projection``) splits both as
    ``w.chunk(3)`` / ``w.split([E, E, E])`` in the order q, k, v.

    Examples:
        >>> import torch
        >>> multihead_attention_layouts(torch.nn.MultiheadAttention(8, 2, kdim=4, vdim=4))
        {'in_proj_bias': Layout(dim=0, sizes=(8, 8, 8), names=('q', 'k', 'v'))}
    """
    m = _expect(module, nn.MultiheadAttention, "multihead_attention_layouts")
    e = m.embed_dim
    if e <= 0:
        return {}
    qkv = Layout(0, (e, e, e), names=QKV)
    out: dict[str, Layout] = {}
    own = _held(m)  # never evaluates a parametrized tensor (orthogonal on meta cannot be)
    if mha_in_proj_packed(m) and "in_proj_weight" in own:
        out["in_proj_weight"] = qkv
    if "in_proj_bias" in own:
        out["in_proj_bias"] = qkv
    return out


def _held(m: nn.Module) -> set[str]:
    """The names of ``m``'s own tensors that are set: Parameters that are not ``None``, parametrized ones."""
    held = module_dict(m).get("parametrizations")
    hooked = {h.name for h in weight_norm_hooks(m)}  # torch's old weight_norm: computed from name_g, name_v
    own = {n for n, p in param_dict(m).items() if p is not None}
    return own | hooked | set(module_dict(held) if held is not None else {})


def gate_names(module: nn.Module) -> tuple[str, ...]:
    if isinstance(module, nn.RNNBase):
        return {"LSTM": LSTM_GATES, "GRU": GRU_GATES}.get(module.mode, RNN_GATES)
    if isinstance(module, nn.LSTMCell):
        return LSTM_GATES
    if isinstance(module, nn.GRUCell):
        return GRU_GATES
    return RNN_GATES


def gate_layout(module: nn.RNNBase | nn.RNNCellBase) -> Layout | None:
    names = gate_names(module)
    h = module.hidden_size
    return Layout(0, (h,) * len(names), names=names) if h > 0 else None


def rnn_layouts(module: nn.Module) -> dict[str, Layout]:
    """Adapter for ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``: gates along dim 0, every layer and direction.

    ``weight_ih_l{k}[_reverse]`` (G*H, I), ``weight_hh_l{k}[_reverse]`` (G*H, H or
    proj_size), ``bias_ih_*`` and ``bias_hh_*`` (G*H,) hold G gates of H rows:
    LSTM ``i, f, g, o`` (G = 4), GRU ``r, z, n`` (G = 3), in the order the cuDNN
    / ATen kernels (and ``_VF.lstm_cell``'s ``gates.chunk(4, 1)``) read them.
    ``weight_hr_*`` (proj_size, H) is one matrix. A plain RNN has one gate, so
    nothing is packed and the result is empty.

    Examples:
        >>> import torch
        >>> sorted(rnn_layouts(torch.nn.GRU(3, 5, bidirectional=True)))
        ['bias_hh_l0', 'bias_hh_l0_reverse', 'bias_ih_l0', 'bias_ih_l0_reverse', 'weight_hh_l0', ...]
        >>> rnn_layouts(torch.nn.LSTM(3, 5))["weight_hh_l0"]
        Layout(dim=0, sizes=(5, 5, 5, 5), names=('i', 'f', 'g', 'o'))
    """
    m = _expect(module, nn.RNNBase, "rnn_layouts")
    gates = gate_layout(m)
    if gates is None or gates.num_parts == 1:
        return {}
    return {n: gates for n in _gate_params(m, rnn_weight_names(m))}


def rnn_cell_layouts(module: nn.Module) -> dict[str, Layout]:
    """Adapter for ``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell``: gates along dim 0.

    Examples:
        >>> import torch
        >>> rnn_cell_layouts(torch.nn.GRUCell(3, 5))["weight_ih"]
        Layout(dim=0, sizes=(5, 5, 5), names=('r', 'z', 'n'))
    """
    m = _expect(module, nn.RNNCellBase, "rnn_cell_layouts")
    gates = gate_layout(m)
    if gates is None or gates.num_parts == 1:
        return {}
    return {n: gates for n in _gate_params(m, ["weight_ih", "weight_hh", "bias_ih", "bias_hh"])}


def _gate_params(m: nn.RNNBase | nn.RNNCellBase, names: list[str]) -> list[str]:
    """The names among torch's own gate tensors that ``m`` holds (a parametrized one included).

    Only what torch itself creates is claimed: a subclass's extra Parameter (a learned ``h0``,
    a gain) is one block, as any other parameter; ``weight_hr*`` (``proj_size``) is one matrix.
    """
    own = _held(m)
    return [n for n in names if n in own and not n.startswith("weight_hr")]


#: The torch.nn adapters, registered (in this order) on the registry's first use.
ADAPTERS: Mapping[type[nn.Module], Adapter] = {
    nn.MultiheadAttention: multihead_attention_layouts,
    nn.RNNBase: rnn_layouts,
    nn.LSTM: rnn_layouts,
    nn.GRU: rnn_layouts,
    nn.RNN: rnn_layouts,
    nn.LSTMCell: rnn_cell_layouts,
    nn.GRUCell: rnn_cell_layouts,
    nn.RNNCell: rnn_cell_layouts,
}
