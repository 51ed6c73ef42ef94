"""The idioms people already write: right after one `annotate(model)`, or loud; filters without partial.

- bare-parameter loops (`for p in model.parameters()`), nanoGPT's `_init_weights` through
  `model.apply`, a direct `chunked(f)(mha.in_proj_weight)`: per block once annotated, and the
  mark survives `.to`, `to_empty`, `deepcopy`, `load_state_dict`, `fully_shard`;
- `init_model(model, f, modules=..., params=...)` and `init_recurrent_(..., gain=...)`.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn import init

import packedinit
from packedinit import Layout, PackedInitError, chunked, chunked_init, init_model, init_recurrent_

E = 32
PER_BLOCK = math.sqrt(6 / (E + E))  # xavier bound of one (E, E) block
PACKED = math.sqrt(6 / (3 * E + E))  # xavier bound of the packed (3E, E) tensor


def per_block(w: Tensor) -> bool:
    """Max |w| beyond the packed bound, within the per-block one: only per-block xavier does that."""
    m = float(w.detach().abs().max())
    return PACKED < m <= PER_BLOCK + 1e-7


class Attention(nn.Module):
    """nanoGPT's CausalSelfAttention: one fused c_attn Linear(E, 3E)."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(E, 3 * E)
        self.c_proj = nn.Linear(E, E)


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([Attention() for _ in range(2)])
        self.mlp = nn.Linear(E, 4 * E)

    def _init_weights(self, module: nn.Module) -> None:  # nanoGPT's idiom, with packedinit's xavier
        if isinstance(module, nn.Linear):
            chunked(init.xavier_uniform_)(module.weight)
            nn.init.zeros_(module.bias)


def annotated_gpt() -> GPT:
    model = GPT()
    for block in model.h:
        packedinit.annotate(block, **{"c_attn.weight": Layout(0, [E, E, E], names=("q", "k", "v"))})
    return model


def loop(model: nn.Module) -> None:
    for p in model.parameters():
        if p.dim() > 1:
            chunked(init.xavier_uniform_)(p)


def test_without_annotation_a_bare_parameter_is_one_block() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, 4)
    chunked(init.xavier_uniform_)(mha.in_proj_weight)  # the torch.nn.init contract: one tensor, one block
    assert float(mha.in_proj_weight.detach().abs().max()) <= PACKED


def test_annotated_model_parameters_loop_is_per_block_and_bit_identical() -> None:
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(E, 4)
    packedinit.annotate(model)  # no keywords: stamp what the adapters know
    torch.manual_seed(1)
    loop(model)
    assert per_block(model.self_attn.in_proj_weight)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    init_model(ref, init.xavier_uniform_)  # the whole-model call: same draws in the same order
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_direct_call_on_an_annotated_in_proj_weight() -> None:
    mha = packedinit.annotate(nn.MultiheadAttention(E, 4))
    chunked(init.xavier_uniform_)(mha.in_proj_weight)
    assert per_block(mha.in_proj_weight)
    chunked_init(mha.in_proj_weight, None, None, init.xavier_uniform_)
    assert per_block(mha.in_proj_weight)
    chunked_init(mha.in_proj_weight, 1, 0, init.xavier_uniform_)  # an explicit one block stays one block
    assert float(mha.in_proj_weight.detach().abs().max()) <= PACKED


def test_nanogpt_init_weights_through_apply() -> None:
    model = annotated_gpt()
    model.apply(model._init_weights)
    for block in model.h:
        assert per_block(block.c_attn.weight)
    bound = math.sqrt(6 / (E + 4 * E))
    assert float(model.mlp.weight.detach().abs().max()) <= bound  # fc1: an MLP expansion, one block


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.to(torch.float64),
        lambda m: copy.deepcopy(m),
        lambda m: (m.load_state_dict(GPT().state_dict()), m)[1],
        lambda m: m.to_empty(device="cpu"),
    ],
    ids=["to", "deepcopy", "load_state_dict", "to_empty"],
)
def test_the_mark_survives(change: Callable[[nn.Module], nn.Module]) -> None:
    model = annotated_gpt()
    model = change(model)
    loop(model)
    for block in model.h:
        assert per_block(block.c_attn.weight)


def test_the_mark_survives_meta_then_to_empty() -> None:
    with torch.device("meta"):
        model = GPT()
    for block in model.h:
        packedinit.annotate(block, **{"c_attn.weight": Layout(0, [E, E, E])})
    model.to_empty(device="cpu")  # replaces every Parameter object
    loop(model)
    for block in model.h:
        assert per_block(block.c_attn.weight)


def test_the_mark_survives_fully_shard(tmp_path: os.PathLike[str]) -> None:
    code = textwrap.dedent(
        f"""
        import math, socket, torch, torch.distributed as dist
        from torch import nn
        from torch.distributed.fsdp import fully_shard
        import packedinit
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
        E = {E}
        mha = nn.MultiheadAttention(E, 4)
        packedinit.annotate(mha)
        fully_shard(mha, mesh=torch.distributed.device_mesh.init_device_mesh("cpu", (1,)))
        for p in mha.parameters():
            if p.dim() > 1:
                packedinit.chunked(torch.nn.init.xavier_uniform_)(p)
        m = float(mha.in_proj_weight.full_tensor().abs().max())
        dist.destroy_process_group()
        print(math.sqrt(6 / (4 * E)) < m <= math.sqrt(6 / (2 * E)) + 1e-7)
        """
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("True")


# -- filters and options without functools.partial ------------------------------------------------------------------
def test_kaiming_on_linear_per_block_xavier_on_attention() -> None:
    model = nn.TransformerEncoderLayer(E, 4, dim_feedforward=4 * E)
    init_model(model, init.kaiming_uniform_, modules=nn.Linear, nonlinearity="relu", a=0.0)
    init_model(model, init.xavier_uniform_, modules=nn.MultiheadAttention)
    assert per_block(model.self_attn.in_proj_weight)
    kaiming = math.sqrt(6 / E)  # relu gain sqrt(2), fan_in E: bound sqrt(3) * sqrt(2) / sqrt(E)
    w1 = model.linear1.weight
    assert math.sqrt(6 / (E + 4 * E)) < float(w1.detach().abs().max()) <= kaiming + 1e-7


def test_params_glob_and_predicate() -> None:
    model = annotated_gpt()
    before = model.mlp.weight.detach().clone()
    init_model(model, init.zeros_, params="h.*.c_attn.weight")
    assert all(float(b.c_attn.weight.detach().abs().max()) == 0 for b in model.h)
    assert torch.equal(before, model.mlp.weight)
    init_model(model, init.ones_, params=lambda name, p: name.endswith("c_proj.weight"))
    assert all(bool(b.c_proj.weight.eq(1).all()) for b in model.h)
    init_model(model, init.ones_, modules=(Attention,), params=["*c_attn*"])
    assert all(bool(b.c_attn.weight.eq(1).all()) for b in model.h)


def test_a_filter_that_keeps_nothing_is_loud_and_writes_nothing() -> None:
    model = GPT()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PackedInitError, match=r"the filters keep no parameter with dim >= 2; nothing was written"):
        init_model(model, init.zeros_, params="*.atn.*")
    with pytest.raises(PackedInitError, match=r"modules must be an nn.Module subclass"):
        init_model(model, init.zeros_, modules="Linear")  # type: ignore[arg-type]  # the bad input under test
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_init_recurrent_takes_options_without_partial() -> None:
    hid = 8
    lstm = init_recurrent_(nn.LSTM(4, hid), hidden_init=init.orthogonal_, gain=2.0)
    w = lstm.weight_hh_l0[hid : 2 * hid].detach()
    assert torch.allclose(w @ w.T, 4 * torch.eye(hid), atol=1e-4)
    bound = 2.0 * math.sqrt(6 / (hid + 4))
    assert float(lstm.weight_ih_l0.detach().abs().max()) <= bound + 1e-6
    gru = init_recurrent_(nn.GRU(4, hid), hidden_kwargs={"gain": 3.0})
    w = gru.weight_hh_l0[:hid].detach()
    assert torch.allclose(w @ w.T, 9 * torch.eye(hid), atol=1e-3)
    with pytest.raises(PackedInitError, match="rejected"):
        init_recurrent_(nn.GRU(4, hid), input_init=init.kaiming_uniform_, input_kwargs={"gain": 2.0})


def test_packedinit_keywords_never_collide_with_torch_init_keywords() -> None:
    torch_names = {
        name
        # torch.nn.init has no __all__ on torch 2.6.0 (it has on 2.13.0 and 2.15.0): its public names then
        for fn in (getattr(init, n) for n in getattr(init, "__all__", dir(init)) if n.endswith("_") and n[0] != "_")
        for name in inspect.signature(fn).parameters
    } - {"tensor", "generator"}
    for fn in (init_model, init_recurrent_, packedinit.reset_parameters):
        own = {
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        }
        assert not own & torch_names, (fn.__name__, own & torch_names)


def test_reset_parameters_respects_a_subclass_default() -> None:
    class ZeroQKV(nn.MultiheadAttention):
        def _reset_parameters(self) -> None:  # this model's own default: torch's, then q/k/v zeroed
            super()._reset_parameters()
            nn.init.zeros_(self.in_proj_weight)

    m = ZeroQKV(E, 4)
    nn.init.ones_(m.in_proj_weight)
    packedinit.reset_parameters(m)
    assert bool(m.in_proj_weight.eq(0).all())
    plain = nn.MultiheadAttention(E, 4)
    packedinit.reset_parameters(plain)
    assert per_block(plain.in_proj_weight)
