"""Every fix the audit prints works (issue 17 item 3): audit, run the printed fix, audit again.

A zoo of models whose packed parameters are initialised by torch, by transformers' own
``_init_weights``, or by code in the style of DETR, MAE, timm's 'jax' scheme, cleanrl and
nanoGPT (written here, in their style, not copied). For each affected model the printed
``report.fix()`` is executed as it is printed; afterwards the model is not affected and every
other parameter is bit-identical (the fix names only the affected parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import transformers
from torch import Tensor, nn

import packedinit
from packedinit import audit

E = 64


# -- code in the style of well-known repositories (written for these tests) ----------------------------
class DetrStyle(nn.Module):
    """DETR's ``_reset_parameters``: xavier_uniform_ on every parameter with dim > 1, attention included."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(E, 4, dim_feedforward=128) for _ in range(2))
        self.query_embed = nn.Embedding(10, E)
        self.bbox = nn.Linear(E, 4)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)


class FusedAttention(nn.Module):
    """A timm/MAE-style attention: one ``qkv`` Linear (E, 3E), then ``proj``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)


class VitBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = FusedAttention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))


class MaeStyle(nn.Module):
    """MAE's ``_init_weights``: xavier_uniform_ on every Linear (the fused qkv included), zero biases."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, E, 4, 4)
        self.blocks = nn.ModuleList(VitBlock(E) for _ in range(2))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.LayerNorm):
            nn.init.constant_(m.weight, 1.0)
            nn.init.constant_(m.bias, 0)


class TimmJaxStyle(nn.Module):
    """timm's 'jax' scheme: xavier_uniform_ on Linear weights, tiny normal biases in the MLP, lecun on the stem."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, E, 4, 4)
        self.blocks = nn.ModuleList(VitBlock(E) for _ in range(2))
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if "mlp" in name:
                    nn.init.normal_(m.bias, std=1e-6)
                else:
                    nn.init.zeros_(m.bias)
        fan_in = 3 * 4 * 4
        nn.init.trunc_normal_(self.patch.weight, std=math.sqrt(1 / fan_in))


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class CleanrlStyle(nn.Module):
    """cleanrl's recurrent PPO agent: orthogonal_ on each whole LSTM weight, zero biases."""

    def __init__(self) -> None:
        super().__init__()
        self.network = nn.Sequential(layer_init(nn.Linear(8, 64)), nn.ReLU())
        self.lstm = nn.LSTM(64, 32)
        for name, param in self.lstm.named_parameters():
            if "bias" in name:
                nn.init.constant_(param, 0)
            elif "weight" in name:
                nn.init.orthogonal_(param, 1.0)
        self.actor = layer_init(nn.Linear(32, 4), std=0.01)
        self.critic = layer_init(nn.Linear(32, 1), std=1.0)


class NanoGptAttention(nn.Module):
    """nanoGPT-style: ``c_attn = Linear(E, 3E)``, nobody describes it, the model runs xavier on every matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(E, 3 * E)
        self.c_proj = nn.Linear(E, E)


def nanogpt() -> nn.Module:
    model = nn.ModuleDict({"h0": NanoGptAttention(), "h1": NanoGptAttention()})
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return model


# -- transformers families from tiny configs ------------------------------------------------------------
def siglip() -> nn.Module:
    cfg = transformers.SiglipVisionConfig(
        hidden_size=E, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, image_size=8, patch_size=4,
        vision_use_head=True,
    )  # fmt: skip
    return transformers.SiglipVisionModel(cfg)


def siglip2() -> nn.Module:
    cfg = transformers.Siglip2VisionConfig(
        hidden_size=E, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, patch_size=4, num_patches=4,
        vision_use_head=True,
    )  # fmt: skip
    return transformers.Siglip2VisionModel(cfg)


def mask2former() -> nn.Module:
    backbone = transformers.SwinConfig(
        embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], image_size=32,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )  # fmt: skip
    cfg = transformers.Mask2FormerConfig(
        backbone_config=backbone, hidden_dim=32, mask_feature_size=32, feature_size=32, encoder_layers=1,
        decoder_layers=2, num_queries=4, encoder_feedforward_dim=32, dim_feedforward=32, num_attention_heads=2,
    )  # fmt: skip
    return transformers.Mask2FormerForUniversalSegmentation(cfg)


def encodec() -> nn.Module:
    cfg = transformers.EncodecConfig(
        num_filters=8, hidden_size=32, codebook_size=8, num_lstm_layers=1, upsampling_ratios=[2, 2],
        target_bandwidths=[1.5], codebook_dim=32,
    )  # fmt: skip
    return transformers.EncodecModel(cfg)


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_embd=E, n_layer=2, n_head=4, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2Model(cfg)


def gpt_neox() -> nn.Module:
    cfg = transformers.GPTNeoXConfig(
        hidden_size=E, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=50,
        max_position_embeddings=16,
    )  # fmt: skip
    return transformers.GPTNeoXModel(cfg)


#: name -> (factory, affected as built)
ZOO: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "torch MultiheadAttention": (lambda: nn.MultiheadAttention(E, 4), True),
    "torch TransformerEncoderLayer": (lambda: nn.TransformerEncoderLayer(E, 4, dim_feedforward=128), True),
    "torch Transformer": (lambda: nn.Transformer(E, 4, 1, 1, dim_feedforward=128, batch_first=True), True),
    "torch LSTM 2x bidirectional": (lambda: nn.LSTM(E, 2 * E, num_layers=2, bidirectional=True), False),
    "torch GRU": (lambda: nn.GRU(E, 2 * E), False),
    "transformers SigLIP vision + head": (siglip, True),
    "transformers SigLIP2 vision + head": (siglip2, True),
    "transformers Mask2Former": (mask2former, True),
    "transformers Encodec": (encodec, True),
    "transformers GPT-2": (gpt2, False),
    "transformers GPT-NeoX": (gpt_neox, False),
    "DETR-style": (DetrStyle, True),
    "MAE-style": (MaeStyle, True),
    "timm jax-style": (TimmJaxStyle, True),
    "cleanrl-style": (CleanrlStyle, True),
    "nanoGPT-style (looks packed)": (nanogpt, True),
}


def _snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_fix(name: str) -> tuple[packedinit.AuditReport, packedinit.AuditReport | None, dict[str, Tensor], nn.Module]:
    """Build from seed 0, audit, exec the printed fix; the reports before/after, the values before, the model."""
    make, _ = ZOO[name]
    torch.manual_seed(0)
    model = make()
    before = audit(model)
    values = _snapshot(model)
    fix = before.fix()
    if fix is None:
        return before, None, values, model
    exec(fix, {"packedinit": packedinit, "torch": torch, "model": model})  # the printed line, as printed
    return before, audit(model), values, model


def test_the_zoo_has_at_least_15_models_and_the_affected_ones_are_found() -> None:
    assert len(ZOO) >= 15
    assert sum(affected for _, affected in ZOO.values()) >= 10


@pytest.mark.parametrize("name", list(ZOO))
def test_the_printed_fix_makes_the_model_not_affected_and_keeps_everything_else(name: str) -> None:
    before, after, values, model = run_fix(name)
    expected_affected = ZOO[name][1]
    assert bool(before.affected) is expected_affected, before.answer()
    if not expected_affected:
        assert before.fix() is None
        assert before.answer().startswith("not affected")
        return
    assert after is not None
    assert after.affected == (), after.answer()
    assert after.answer().startswith("not affected"), after.answer()
    fixed = set(before.affected)
    for n, p in model.named_parameters():
        if n in fixed:
            assert not torch.equal(p.detach(), values[n]), n  # re-initialised, per block
        else:
            assert torch.equal(p.detach(), values[n]), n  # the model's own init, untouched
    for n in fixed:  # per block now (or, for cleanrl's orthogonal LSTM, indistinguishable from a packed kaiming)
        verdict = after[n].verdict if n in after else next(s.audit.verdict for s in after.suspects if s.name == n)
        assert verdict in ("per-block", "undecided"), (n, verdict)
        assert verdict == "per-block" or "indistinguishable" in after[n].detail, after[n].detail


def test_a_fix_for_looks_packed_parameters_annotates_them_first() -> None:
    before, after, _, _ = run_fix("nanoGPT-style (looks packed)")
    fix = before.fix()
    assert fix is not None
    assert fix.startswith("packedinit.annotate(model, ")
    assert "params=['h0.c_attn.weight', 'h1.c_attn.weight']" in fix
    assert after is not None
    assert set(after.affected) == set()
    assert {p.name for p in after.params} >= {"h0.c_attn.weight", "h1.c_attn.weight"}  # described now


def _packed_std(report: packedinit.AuditReport, name: str) -> float:
    p = report[name] if name in report else next(s.audit for s in report.suspects if s.name == name)
    return sum(b.std or 0.0 for b in p.blocks) / len(p.blocks)


if __name__ == "__main__":  # the numbers of the issue note: mean block std of each affected parameter, before/after
    verified = 0
    for zoo_name in ZOO:
        rep0, rep1, _, _ = run_fix(zoo_name)
        if rep1 is None:
            print(f"{zoo_name}: not affected ({rep0.answer()[:60]}...)")
            continue
        verified += not rep1.affected
        first = rep0.affected[0]
        print(
            f"{zoo_name}: {len(rep0.affected)} affected; {first}: block std {_packed_std(rep0, first):.4f} -> "
            f"{_packed_std(rep1, first):.4f}; after: {rep1.answer()[:40]}"
        )
    print("verified:", verified)
