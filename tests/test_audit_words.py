"""Issue 11, point 2: words a user can act on. Fan-independent inits are named as such, single-block
transposed storage is counted apart, every report ends with a one-line answer whose fix works, and the
default inits of tiny transformers models read "not affected"."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable

import pytest
import torch
import transformers
from torch import nn

import packedinit
from packedinit.auditing.measure import AuditReport, audit
from packedinit.cli.command import main as cli_main

transformers.logging.set_verbosity_error()
init = nn.init


def _tiny(kind: str) -> nn.Module:
    t = transformers
    configs: dict[str, Callable[[], object]] = {
        "gpt2": lambda: t.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64),
        "neox": lambda: t.GPTNeoXConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=100
        ),
        "falcon": lambda: t.FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100),
        "llama": lambda: t.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=100,
        ),
        "mixtral": lambda: t.MixtralConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=100,
            num_local_experts=4,
        ),
    }
    model = t.AutoModelForCausalLM.from_config(configs[kind]())
    assert isinstance(model, nn.Module)
    return model


@pytest.mark.parametrize("kind", ["gpt2", "neox", "falcon", "llama", "mixtral"])
def test_transformers_defaults_read_not_affected(kind: str) -> None:
    for seed in range(2):
        torch.manual_seed(seed)
        rep = audit(_tiny(kind))
        assert rep.affected == ()
        assert rep.suspects == ()  # the "looks packed" heuristics: no false alarm on these models
        text = str(rep)
        assert text.splitlines()[-1].startswith("answer: not affected")
        assert "unknown" not in text
        assert all(p.verdict in ("fan-independent", "constant", "n/a") for p in rep.params), [
            (p.name, p.detail) for p in rep.params
        ]


def test_gpt2_words_and_counts() -> None:
    torch.manual_seed(0)
    rep = audit(_tiny("gpt2"))
    c_attn = rep["transformer.h.0.attn.c_attn.weight"]
    assert c_attn.verdict == "fan-independent"
    assert c_attn.multi_block
    assert "normal_0.02" in c_attn.matches
    assert "packing does not change it" in c_attn.detail
    c_proj = rep["transformer.h.1.attn.c_proj.weight"]  # HF's scaled residual: normal(0, 0.02 / sqrt(2 * 2))
    assert c_proj.verdict == "fan-independent"
    assert c_proj.matches == ("scaled_residual",)
    assert c_proj.blocks[0].std == pytest.approx(0.02 / math.sqrt(4), rel=0.15)
    assert "initializer_range / sqrt(2 * n_layer)" in c_proj.detail
    assert not c_proj.multi_block
    assert rep.to_dict()["storage"] == {"multi_block": 4, "single_block": 6}
    assert "4 packed parameter(s) (2 constant, 2 fan-independent)" in rep.summary()
    assert "6 single-block stored transposed or batched (6 fan-independent)" in rep.summary()
    doc = json.loads(rep.to_json())
    assert doc["affected"] == []
    assert doc["fix"] is None
    assert doc["answer"].startswith("not affected: none of 10 packed parameter(s)")


def test_check_exits_zero_on_gpt2() -> None:
    out, err = io.StringIO(), io.StringIO()
    args = ["audit", "--check", "transformers:GPT2Config", "n_layer=2", "n_embd=32", "n_head=4"]
    assert cli_main(args, stdout=out, stderr=err) == 0, out.getvalue() + err.getvalue()
    assert out.getvalue().rstrip().splitlines()[-1].startswith("answer: not affected")


def test_constant_and_recurrent_default_words() -> None:
    torch.manual_seed(0)
    rep = audit(nn.LSTM(32, 64))
    ih = rep["weight_ih_l0"]
    assert ih.verdict == "fan-independent"
    assert ih.detail.startswith("fan-independent: rnn_default (torch's recurrent default)")
    assert "packing does not change it" in ih.detail
    with torch.no_grad():
        rep_lstm = nn.LSTM(8, 16)
        rep_lstm.bias_ih_l0.fill_(1.0)
    assert audit(rep_lstm)["bias_ih_l0"].verdict == "constant"


def _fix(rep: AuditReport, model: nn.Module) -> None:
    call = rep.fix()
    assert call is not None
    exec(call, {"packedinit": packedinit, "torch": torch, "model": model})  # the line the report prints


def test_answer_names_count_and_a_fix_that_works_mha() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.MultiheadAttention(64, 4), "b": nn.MultiheadAttention(64, 4)})
    rep = audit(model)
    assert rep.affected == ("a.in_proj_weight", "b.in_proj_weight")
    assert " ".join(str(rep).partition("\nanswer: ")[2].split()) == rep.answer()  # the table ends with it, wrapped
    last = "answer: " + rep.answer()
    assert last == (
        "answer: affected: 2 packed parameters initialised whole (a.in_proj_weight, b.in_proj_weight); "
        "fix: packedinit.init_model(model, torch.nn.init.xavier_uniform_, params=['a.in_proj_weight', "
        "'b.in_proj_weight'])"
    )
    _fix(rep, model)
    assert audit(model).affected == ()


def test_answer_fix_for_a_user_init_works_lstm() -> None:
    torch.manual_seed(1)
    lstm = nn.LSTM(64, 128)
    for name in ("weight_ih_l0", "weight_hh_l0"):
        init.xavier_normal_(lstm.get_parameter(name))  # the forum recipe, on the packed tensors
    rep = audit(lstm)
    assert rep.affected == ("weight_ih_l0", "weight_hh_l0")
    assert rep["weight_ih_l0"].fns == ("xavier_normal_",)  # the kurtosis says normal, not uniform
    assert rep.fix() == (
        "packedinit.init_model(model, torch.nn.init.xavier_normal_, params=['weight_ih_l0', 'weight_hh_l0'])"
    )
    assert rep.answer().startswith("affected: 2 packed parameters initialised whole (weight_ih_l0, weight_hh_l0)")
    _fix(rep, lstm)
    after = audit(lstm)
    assert after.affected == ()
    assert after["weight_ih_l0"].verdict == "per-block"


def test_single_block_storage_is_counted_and_worded_apart() -> None:
    torch.manual_seed(2)
    model = _tiny("gpt2")
    c_fc = model.get_parameter("transformer.h.0.mlp.c_fc.weight")  # Conv1D: stored (in, out) = (32, 128)
    init.kaiming_uniform_(c_fc)  # reads the stored shape: fan_in 128, which is also the logical fan_out
    rep = audit(model)
    p = rep["transformer.h.0.mlp.c_fc.weight"]
    assert not p.multi_block
    assert p.verdict == "undecided"  # kaiming_in on the stored tensor == kaiming_out per block: cannot tell
    assert p.detail == (
        "undecided: fits packed kaiming_in and per-block kaiming_out (indistinguishable: the same distribution here)"
    )
    assert rep.affected == ()
    assert "6 single-block stored transposed or batched (5 fan-independent, 1 undecided)" in rep.summary()
    torch.manual_seed(3)
    moe = _tiny("mixtral")
    down = moe.get_parameter("model.layers.0.mlp.experts.down_proj")  # (experts, out, in): one block per expert
    init.xavier_uniform_(down)  # fans of the 3-D tensor, not of each expert's (out, in)
    rep = audit(moe)
    q = rep["model.layers.0.mlp.experts.down_proj"]
    assert not q.multi_block
    assert q.detail.startswith("packed (the init ran on the stored shape, not the logical one): xavier")
    assert rep.affected == ("model.layers.0.mlp.experts.down_proj",)
    assert rep.fix() == (
        "packedinit.init_model(model, torch.nn.init.xavier_uniform_, params=['model.layers.0.mlp.experts.down_proj'])"
    )


def test_fix_keeps_a_users_own_init_on_mha_and_mixed_blocks() -> None:
    torch.manual_seed(4)
    mha = nn.MultiheadAttention(64, 4)
    init.orthogonal_(mha.in_proj_weight)  # the user's init, on the packed tensor: not torch's default
    rep = audit(mha)
    assert rep["in_proj_weight"].matches == ("orthogonal",)
    assert rep.fix() == "packedinit.init_model(model, torch.nn.init.orthogonal_, params=['in_proj_weight'])"
    init.xavier_uniform_(mha.in_proj_weight)
    with torch.no_grad():  # q re-initialised on its own with normal(0, 0.02): per block; k, v still packed
        mha.in_proj_weight[:64].normal_(0, 0.02)
    p = audit(mha)["in_proj_weight"]
    assert p.verdict == "mixed"
    assert p.detail == "mixed: per-block q; packed k, v"
