"""packedinit.fix_torch_defaults(): torch's own construction, packed parameters per block, and back."""

from __future__ import annotations

import math
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.init import xavier_uniform_

import packedinit
from packedinit import Layout, PackedInitError, audit, init_model, layouts, reset_parameters
from packedinit.recipes.torch_defaults import TorchDefaultsFix, fix_torch_defaults, torch_defaults_fixed

#: torch's own methods, read before any test could replace them.
TORCH_MHA = nn.MultiheadAttention.__dict__["_reset_parameters"]
TORCH_TRANSFORMER = nn.Transformer.__dict__["_reset_parameters"]

PAGE = Path(__file__).resolve().parent.parent / "docs" / "pages" / "torch-defaults.md"


def torch_methods_in_place() -> bool:
    return (
        nn.MultiheadAttention.__dict__["_reset_parameters"] is TORCH_MHA
        and nn.Transformer.__dict__["_reset_parameters"] is TORCH_TRANSFORMER
    )


@pytest.fixture(autouse=True)
def _fix_is_off_around_every_test() -> Iterator[None]:
    assert torch_methods_in_place()
    assert not torch_defaults_fixed()
    yield
    leaked = not torch_methods_in_place() or torch_defaults_fixed()
    nn.MultiheadAttention._reset_parameters = TORCH_MHA  # type: ignore[method-assign]  # so one leak stays one failure
    nn.Transformer._reset_parameters = TORCH_TRANSFORMER  # type: ignore[method-assign]  # same
    assert not leaked, "a test left the fix on"


def blocks(p: Tensor, layout: Layout) -> list[Tensor]:
    out = []
    for b in layout.blocks(p.shape):
        view = layout.logical_view(p, b)
        assert view is not None
        out.append(view)
    return out


def params(m: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def seeded(seed: int, make: Callable[[], nn.Module], *, fixed: bool) -> tuple[nn.Module, Tensor]:
    """``make()`` from ``seed``, under the fix or not; the module and the RNG state after it."""
    torch.manual_seed(seed)
    if fixed:
        with fix_torch_defaults():
            m = make()
    else:
        m = make()
    return m, torch.get_rng_state()


def reset_from(seed: int, make: Callable[[], nn.Module]) -> tuple[nn.Module, Tensor]:
    """``make()`` without the fix, then ``packedinit.reset_parameters`` from ``seed``; the RNG state after."""
    m = make()
    torch.manual_seed(seed)
    reset_parameters(m)
    return m, torch.get_rng_state()


def assert_same(a: nn.Module, b: nn.Module) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def assert_per_block_xavier(model: nn.Module) -> int:
    """Every packed matrix of ``model`` is xavier per block: within the block's bound, beyond the packed one."""
    lay = layouts(model)
    checked = 0
    for name, p in model.named_parameters():
        if name not in lay or p.dim() < 2 or lay[name].batch_dims:
            continue  # stacked experts: transformers' own init draws them with normal_ (no fans), not xavier
        layout = lay[name]
        parts = blocks(p.detach(), layout)
        packed_bound = math.sqrt(6 / (p.shape[0] + p.shape[1]))
        for blk in parts:
            assert blk.abs().max() <= math.sqrt(6 / sum(blk.shape)), name
            assert blk.abs().max() > packed_bound, name  # torch's packed draw never gets here
        checked += 1
    return checked


# -- per-block bounds -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "matrices"),
    [
        (lambda: nn.MultiheadAttention(64, 4), 1),
        (lambda: nn.TransformerEncoderLayer(64, 4, dim_feedforward=32, batch_first=True), 1),
        (lambda: nn.TransformerDecoderLayer(64, 4, dim_feedforward=32, batch_first=True), 2),
        (lambda: nn.Transformer(64, 4, 2, 2, dim_feedforward=32, batch_first=True), 2 + 2 * 2),
    ],
    ids=["mha", "encoder_layer", "decoder_layer", "transformer"],
)
def test_built_under_the_fix_packed_matrices_are_xavier_per_block(make: Callable[[], nn.Module], matrices: int) -> None:
    torch.manual_seed(0)
    with fix_torch_defaults():
        model = make()
    assert assert_per_block_xavier(model) == matrices
    torch.manual_seed(0)
    plain = make()  # outside the fix: torch's packed bound
    found = 0
    for name in layouts(plain):
        p = plain.get_parameter(name)
        if p.dim() == 2:
            assert p.abs().max() <= math.sqrt(6 / (p.shape[0] + p.shape[1])), name
            found += 1
    assert found == matrices


# -- bit-identity with reset_parameters -----------------------------------------------------------------
@given(
    e=st.sampled_from([4, 8, 12]),
    heads=st.sampled_from([1, 2, 4]),
    bias=st.booleans(),
    add_bias_kv=st.booleans(),
    kdim=st.sampled_from([None, 3]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_mha_under_the_fix_is_bit_identical_to_reset_parameters(
    e: int, heads: int, bias: bool, add_bias_kv: bool, kdim: int | None, dtype: torch.dtype, seed: int
) -> None:
    def make() -> nn.Module:
        return nn.MultiheadAttention(e, heads, bias=bias, add_bias_kv=add_bias_kv, kdim=kdim, vdim=kdim, dtype=dtype)

    fixed, after_fixed = seeded(seed, make, fixed=True)
    reset, after_reset = reset_from(seed, make)
    assert_same(fixed, reset)
    assert torch.equal(after_fixed, after_reset)  # the same draws: the global RNG ends in the same state
    torch_built, after_torch = seeded(seed, make, fixed=False)
    assert torch.equal(after_fixed, after_torch)  # ... as many as torch's own construction makes
    for name, p in params(torch_built).items():
        if name != "in_proj_weight":
            assert torch.equal(p, params(fixed)[name]), name  # only the packed matrix changed


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", [nn.TransformerEncoderLayer, nn.TransformerDecoderLayer])
def test_transformer_layers_under_the_fix_are_bit_identical_to_reset_parameters(
    kind: type[nn.Module], bias: bool, norm_first: bool
) -> None:
    def make() -> nn.Module:
        return kind(16, 2, dim_feedforward=24, batch_first=True, bias=bias, norm_first=norm_first)

    fixed, after_fixed = seeded(7, make, fixed=True)
    reset, after_reset = reset_from(7, make)
    assert_same(fixed, reset)
    assert torch.equal(after_fixed, after_reset)


def test_transformer_with_one_layer_each_is_bit_identical_to_reset_parameters() -> None:
    def make() -> nn.Module:
        return nn.Transformer(16, 2, 1, 1, dim_feedforward=24, batch_first=True)

    fixed, after_fixed = seeded(3, make, fixed=True)
    reset, after_reset = reset_from(3, make)
    assert_same(fixed, reset)
    assert torch.equal(after_fixed, after_reset)


def test_deep_transformer_is_torch_construction_with_only_the_packed_bound_changed() -> None:
    """With N > 1 layers torch builds one layer and deep-copies it; packedinit.reset_parameters draws each
    layer (see the docs). What holds: every parameter but the packed ones is bit-identical to torch's own
    construction, and the packed ones are torch's very draws at the per-block bound (x sqrt(2))."""

    def make() -> nn.Module:
        return nn.Transformer(16, 2, 2, 3, dim_feedforward=24, batch_first=True)

    fixed, after_fixed = seeded(5, make, fixed=True)
    plain, after_plain = seeded(5, make, fixed=False)
    assert torch.equal(after_fixed, after_plain)
    packed = {n for n in layouts(plain) if plain.get_parameter(n).dim() == 2}
    assert len(packed) == 2 + 3 * 2
    got = params(fixed)
    for name, p in params(plain).items():
        if name in packed:
            torch.testing.assert_close(got[name], p * math.sqrt(2), rtol=1e-5, atol=1e-6)
            assert not torch.equal(got[name], p)
        else:
            assert torch.equal(got[name], p), name
    assert assert_per_block_xavier(fixed) == len(packed)
    # construction clones: every encoder layer starts with layer 0's biases, under the fix as without it
    assert torch.equal(got["encoder.layers.1.linear1.bias"], got["encoder.layers.0.linear1.bias"])
    reset, _ = reset_from(5, make)  # reset_parameters draws every layer: the clones' biases differ
    assert not torch.equal(reset.get_parameter("encoder.layers.1.linear1.bias"), got["encoder.layers.1.linear1.bias"])


def test_transformer_fix_runs_xavier_per_block_in_torchs_parameter_order() -> None:
    """A subclass with its own ``_reset_parameters`` keeps it (here: record the RNG state torch's pass starts
    from); from that state, init_model(xavier_uniform_) (per block, parameters() order) gives what the fix
    gives nn.Transformer."""

    class Recording(nn.Transformer):
        start: Tensor

        def _reset_parameters(self) -> None:
            self.start = torch.get_rng_state()

    def make(cls: type[nn.Transformer]) -> Callable[[], nn.Module]:
        return lambda: cls(16, 2, 2, 2, dim_feedforward=24, batch_first=True)

    fixed, _ = seeded(9, make(nn.Transformer), fixed=True)
    rec, _ = seeded(9, make(Recording), fixed=True)
    assert isinstance(rec, Recording)
    torch.set_rng_state(rec.start)
    init_model(rec, xavier_uniform_)
    assert_same(fixed, rec)


# -- off again: undo, with, nesting, threads ------------------------------------------------------------
def packed_bound_holds(e: int = 32) -> bool:
    mha = nn.MultiheadAttention(e, 4)
    return bool(mha.in_proj_weight.abs().max() <= math.sqrt(6 / (4 * e)))


def test_undo_restores_torchs_own_methods_and_packed_bound() -> None:
    torch.manual_seed(1)
    before = nn.MultiheadAttention(32, 4)
    kept = params(before)
    fix = fix_torch_defaults()
    assert isinstance(fix, TorchDefaultsFix)
    assert fix.active
    assert torch_defaults_fixed()
    assert not torch_methods_in_place()
    assert not packed_bound_holds()
    during = nn.MultiheadAttention(32, 4)
    during_values = params(during)
    fix.undo()
    assert not fix.active
    assert not torch_defaults_fixed()
    assert torch_methods_in_place()  # the very function objects torch defined
    assert packed_bound_holds()
    assert_same(before, before)
    assert all(torch.equal(kept[n], p) for n, p in params(before).items())  # built before: never touched
    assert all(torch.equal(during_values[n], p) for n, p in params(during).items())  # built during: kept
    fix.undo()  # twice is harmless
    assert torch_methods_in_place()
    assert repr(fix) == "<packedinit.fix_torch_defaults handle: undone>"


def test_with_block_restores_on_exit_and_when_the_body_raises() -> None:
    with fix_torch_defaults() as fix:
        assert fix.active
        assert repr(fix) == "<packedinit.fix_torch_defaults handle: on>"
        assert not packed_bound_holds()
    assert torch_methods_in_place()
    assert packed_bound_holds()

    def build_then_fail() -> None:
        with fix_torch_defaults():
            nn.MultiheadAttention(32, 4)
            raise RuntimeError("model build failed")

    with pytest.raises(RuntimeError, match="model build failed"):
        build_then_fail()
    assert torch_methods_in_place()
    assert not torch_defaults_fixed()
    assert packed_bound_holds()


def test_nested_and_overlapping_handles_count_references() -> None:
    with fix_torch_defaults():
        with fix_torch_defaults():
            assert not packed_bound_holds()
        assert not packed_bound_holds()  # the inner exit keeps the outer one's fix
        assert not torch_methods_in_place()
    assert torch_methods_in_place()
    first, second = fix_torch_defaults(), fix_torch_defaults()
    first.undo()
    first.undo()  # a second undo of the same handle does not take the other's reference
    assert torch_defaults_fixed()
    assert not packed_bound_holds()
    second.undo()
    assert torch_methods_in_place()
    assert packed_bound_holds()


def test_entering_an_undone_handle_is_an_error() -> None:
    fix = fix_torch_defaults()
    fix.undo()
    with pytest.raises(PackedInitError, match=r"already undone.*with packedinit\.fix_torch_defaults\(\)"), fix:
        pass
    assert torch_methods_in_place()


@given(st.lists(st.one_of(st.just(-1), st.integers(0, 5)), max_size=30))
def test_any_sequence_of_fixes_and_undos_keeps_the_count(ops: list[int]) -> None:
    """-1 makes a handle; i undoes handle i (if made): fixed exactly while some handle is on."""
    handles: list[TorchDefaultsFix] = []
    try:
        for op in ops:
            if op < 0:
                handles.append(fix_torch_defaults())
            elif op < len(handles):
                handles[op].undo()
            on = any(h.active for h in handles)
            assert torch_defaults_fixed() is on
            assert torch_methods_in_place() is not on
    finally:
        for h in handles:
            h.undo()
    assert torch_methods_in_place()


def test_threads_each_holding_the_fix_see_it_on() -> None:
    """Process-wide and reference counted under a lock: a thread's own with-block is never switched off by
    another thread's exit, and the last exit restores torch."""
    errors: list[str] = []
    start = threading.Barrier(6)

    def work() -> None:
        start.wait()
        for _ in range(5000):
            with fix_torch_defaults():
                if nn.MultiheadAttention.__dict__["_reset_parameters"] is TORCH_MHA:
                    errors.append("torch's method inside a with-block")

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so the bookkeeping is interleaved
    try:
        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []
    assert torch_methods_in_place()
    assert not torch_defaults_fixed()


# -- subclasses -----------------------------------------------------------------------------------------
class OwnInit(nn.MultiheadAttention):
    def _reset_parameters(self) -> None:
        with torch.no_grad():
            self.in_proj_weight.fill_(0.25)
            self.in_proj_bias.fill_(-0.25)


class SuperThenScale(nn.MultiheadAttention):
    def _reset_parameters(self) -> None:
        super()._reset_parameters()  # torch's method; its xavier_uniform_ on in_proj_weight is per block
        with torch.no_grad():
            self.in_proj_weight.mul_(0.5)


class NoOverride(nn.MultiheadAttention):
    pass


def test_subclasses_with_their_own_reset_parameters_are_respected() -> None:
    with fix_torch_defaults():
        own = OwnInit(16, 2)
    assert torch.equal(own.in_proj_weight, torch.full((48, 16), 0.25))
    fixed, _ = seeded(2, lambda: OwnInit(16, 2), fixed=True)
    plain, _ = seeded(2, lambda: OwnInit(16, 2), fixed=False)
    assert_same(fixed, plain)  # exactly what torch builds without the fix
    # super() reaches torch's own method, whose xavier_uniform_ call on the packed Parameter runs per block
    fixed, _ = seeded(2, lambda: SuperThenScale(16, 2), fixed=True)
    plain, _ = seeded(2, lambda: SuperThenScale(16, 2), fixed=False)
    w, e = fixed.in_proj_weight.detach(), 16
    assert float(plain.in_proj_weight.detach().abs().max()) <= 0.5 * math.sqrt(6 / (4 * e))
    assert 0.5 * math.sqrt(6 / (4 * e)) < float(w.abs().max()) <= 0.5 * math.sqrt(6 / (2 * e))
    assert torch.equal(fixed.in_proj_bias, plain.in_proj_bias)
    fixed, _ = seeded(2, lambda: NoOverride(16, 2), fixed=True)  # no method of its own: the fix applies
    reset, _ = reset_from(2, lambda: NoOverride(16, 2))
    assert_same(fixed, reset)
    assert assert_per_block_xavier(fixed) == 1


# -- audit, meta, third-party code ---------------------------------------------------------------------
def test_audit_reports_a_model_built_under_the_fix_per_block() -> None:
    def make() -> nn.Module:
        layer = nn.TransformerEncoderLayer(128, 4, dim_feedforward=64, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    fixed, _ = seeded(0, make, fixed=True)
    plain, _ = seeded(0, make, fixed=False)
    for i in range(2):
        name = f"layers.{i}.self_attn.in_proj_weight"
        assert [b.verdict for b in audit(fixed)[name].blocks] == ["per-block"] * 3
        assert audit(fixed)[name].verdict == "per-block"
        assert [b.verdict for b in audit(plain)[name].blocks] == ["packed"] * 3


def test_library_code_that_builds_attention_inside_gets_the_fix() -> None:
    class Pooler(nn.Module):  # stands for any model whose code you cannot edit
        def __init__(self, e: int) -> None:
            super().__init__()
            self.query = nn.Parameter(torch.zeros(1, 1, e))
            self.attention = nn.MultiheadAttention(e, 4, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(e, 2 * e), nn.GELU(), nn.Linear(2 * e, e))

    fix = packedinit.fix_torch_defaults()  # the one line (a script may drop the handle: on for good)
    try:
        fixed = Pooler(32)
    finally:
        fix.undo()
    assert assert_per_block_xavier(fixed) == 1
    assert packed_bound_holds()


def aria() -> nn.Module:
    """A tiny transformers AriaModel: its projector builds an nn.MultiheadAttention, and transformers' own
    ``_init_weights`` then calls ``module._reset_parameters()`` on it (torch's method, or the fixed one)."""
    cfg = transformers.AriaConfig(
        vision_config={
            "model_type": "idefics3_vision",
            "hidden_size": 64,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "image_size": 8,
            "patch_size": 4,
        },
        text_config={
            "hidden_size": 32,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "moe_num_experts": 2,
            "moe_topk": 1,
            "moe_intermediate_size": 8,
            "vocab_size": 64,
        },
        projector_patch_to_query_dict={4: 4},
    )
    return transformers.AriaModel(cfg)


def siglip_with_head() -> nn.Module:
    """A tiny SiglipVisionModel whose own ``_init_weights`` runs xavier_uniform_ on the packed in_proj_weight."""
    cfg = transformers.SiglipVisionConfig(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=8,
        patch_size=4,
        vision_use_head=True,
    )
    return transformers.SiglipVisionModel(cfg)


def test_transformers_model_initialised_through_torchs_method_is_per_block() -> None:
    name = "multi_modal_projector.cross_attn.multihead_attn.in_proj_weight"
    fixed, _ = seeded(0, aria, fixed=True)
    plain, _ = seeded(0, aria, fixed=False)
    assert [b.verdict for b in audit(fixed)[name].blocks] == ["per-block"] * 3
    assert [b.verdict for b in audit(plain)[name].blocks] == ["packed"] * 3
    assert assert_per_block_xavier(fixed) == 1


def test_a_library_init_that_runs_xavier_on_the_packed_tensor_itself_is_per_block_under_the_fix() -> None:
    """SigLIP's _init_weights calls xavier_uniform_(in_proj_weight) itself, after construction; under the fix
    that call runs per block (issue 17; before, it stayed packed and only chunked(...)(model) reached it)."""
    name = "head.attention.in_proj_weight"
    fixed, _ = seeded(0, siglip_with_head, fixed=True)
    assert [b.verdict for b in audit(fixed)[name].blocks] == ["per-block"] * 3
    plain, _ = seeded(0, siglip_with_head, fixed=False)
    assert [b.verdict for b in audit(plain)[name].blocks] == ["packed"] * 3


@pytest.mark.parametrize("how", ["device_kwarg", "device_context"])
def test_meta_construction_under_the_fix(how: str) -> None:
    def make() -> nn.Module:
        if how == "device_kwarg":
            return nn.Transformer(16, 2, 1, 1, dim_feedforward=8, batch_first=True, device="meta")
        with torch.device("meta"):
            return nn.Transformer(16, 2, 1, 1, dim_feedforward=8, batch_first=True)

    with fix_torch_defaults():
        model = make()
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    reset_parameters(model, generator=torch.Generator().manual_seed(0))
    assert assert_per_block_xavier(model) == 3


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_construction_under_inference_mode_or_no_grad(mode: Callable[[], AbstractContextManager[object]]) -> None:
    def make() -> nn.Module:
        return nn.TransformerEncoderLayer(16, 2, dim_feedforward=8, batch_first=True)

    with mode():
        fixed, _ = seeded(4, make, fixed=True)
        reset, _ = reset_from(4, make)  # written in the same mode: inference tensors can only be written there
    assert_same(fixed, reset)
    assert fixed.get_parameter("self_attn.in_proj_weight").is_inference() is (mode is torch.inference_mode)


# -- errors and other code ------------------------------------------------------------------------------
def test_a_torch_without_the_method_is_refused_and_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(nn.Transformer, "_reset_parameters")  # what a future torch might look like
    with pytest.raises(PackedInitError, match=r"has no _reset_parameters method on Transformer.*reset_parameters"):
        fix_torch_defaults()
    assert nn.MultiheadAttention.__dict__["_reset_parameters"] is TORCH_MHA
    assert not torch_defaults_fixed()


def test_undo_leaves_a_method_that_other_code_set_meanwhile() -> None:
    def theirs(self: nn.MultiheadAttention) -> None:
        TORCH_MHA(self)

    fix = fix_torch_defaults()
    try:
        nn.MultiheadAttention._reset_parameters = theirs  # type: ignore[method-assign]  # other code patches too
        with pytest.warns(RuntimeWarning, match=r"MultiheadAttention\._reset_parameters was replaced by other code"):
            fix.undo()
        assert nn.MultiheadAttention.__dict__["_reset_parameters"] is theirs  # not clobbered
        assert nn.Transformer.__dict__["_reset_parameters"] is TORCH_TRANSFORMER
        with fix_torch_defaults():  # on again: wraps whatever is there now, and gives it back
            assert not packed_bound_holds()
        assert nn.MultiheadAttention.__dict__["_reset_parameters"] is theirs
    finally:
        nn.MultiheadAttention._reset_parameters = TORCH_MHA  # type: ignore[method-assign]  # torch's again


def test_exported_from_the_package() -> None:
    assert packedinit.fix_torch_defaults is fix_torch_defaults
    assert "fix_torch_defaults" in packedinit.__all__


def test_docs_page_code_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
    assert code
    for block in code:
        exec(compile(block, str(PAGE), "exec"), {"__name__": "__docs__"})  # our own page's examples
    assert torch_methods_in_place()
    out = capsys.readouterr().out
    assert "per-block: True" in out
    assert "torch's default again: True" in out
    assert "fixed now: False" in out
    shown = re.findall(r"^# (\w+: \S+ block std \d\.\d{4} -> \d\.\d{4})", PAGE.read_text(), flags=re.MULTILINE)
    assert len(shown) == 6  # SigLIP, Mask2Former, Encodec, DETR-, MAE-, cleanrl-style
    for line in shown:
        assert line in out  # the stds the page shows are the ones its code prints
