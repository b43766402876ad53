"""FP8 GEMMs, Fp8Linear / Fp8GroupedLinear, conversion, scaling state, and tiny FP8 runs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hyperloom.config import ModelConfig, PrecisionConfig
from hyperloom.engine.fp8 import (
    DEFAULT_KEEP,
    RECIPE_NAMES,
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    Fp8GroupedLinear,
    Fp8Linear,
    RowwiseScaling,
    convert_to_fp8,
    fp8_autocast,
    fp8_gemm,
    fp8_state_dict,
    load_fp8_state_dict,
    quantize_for,
    recipe_from_name,
    tensor_core_gemm,
)
from hyperloom.engine.fp8.modules import fp8_grouped_linear
from hyperloom.models.registry import build_model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# --------------------------------------------------------------------------- GEMM


@pytest.mark.parametrize("recipe", [CurrentScaling(), RowwiseScaling()])
def test_scaled_mm_path_equals_the_emulation(recipe):
    torch.manual_seed(0)
    a = quantize_for(torch.randn(24, 40), recipe, "input")
    b = quantize_for(torch.randn(16, 40), recipe, "weight")
    # torch._scaled_mm on CPU dequantizes, then multiplies in FP32, as the emulation (which
    # CPU uses, converting through a table) does. The two FP32 GEMMs need not sum in one
    # order: on a Xeon with AMX, 272 of 384 elements came out one ulp apart (2.9e-6 on values
    # up to 24), so the bound is a few ulps of the largest output, not bitwise.
    sa, sb = a.scale_inv.reshape(-1, 1), b.scale_inv.reshape(1, -1)
    if a.is_tensorwise:
        sa, sb = sa.reshape(()), sb.reshape(())
    scaled = torch._scaled_mm(a.data, b.data.t(), sa, sb, out_dtype=torch.float32)
    ulp = torch.finfo(torch.float32).eps * scaled.abs().max().item()
    torch.testing.assert_close(fp8_gemm(a, b), scaled, rtol=0, atol=4 * ulp)
    assert fp8_gemm(a, b, torch.bfloat16).dtype == torch.bfloat16


def test_blockwise_gemm_promotes_every_block():
    torch.manual_seed(0)
    a = quantize_for(torch.randn(8, 300), BlockwiseScaling(), "input")
    b = quantize_for(torch.randn(136, 300), BlockwiseScaling(), "weight")
    ref = a.dequantize().double() @ b.dequantize().double().t()
    assert rel(fp8_gemm(a, b), ref) < 1e-6  # FP32 partial sums, scaled per 128-chunk
    with pytest.raises(ValueError, match="contraction dims differ"):
        fp8_gemm(a, quantize_for(torch.randn(4, 200), BlockwiseScaling(), "weight"))


def test_fp32_promotion_lowers_gemm_error_at_k4096():
    """DeepSeek-V3 §3.3.2: a ~14-bit tensor-core accumulator over K = 4096 loses ~0.3%;
    promoting to FP32 every 128 elements removes nearly all of it. Measured (M = N = 32,
    seeds 0-2): accumulation error 1.1e-4 with promotion vs 3.2e-3 without (normal data);
    total error against the exact product of positive data 0.17% vs 0.43%."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 4096, generator=g), torch.randn(32, 4096, generator=g)
    r = BlockwiseScaling()
    qa, qb = quantize_for(x, r, "input"), quantize_for(w, r, "weight")
    exact_q = qa.dequantize().double() @ qb.dequantize().double().t()
    promoted = rel(tensor_core_gemm(qa, qb, promote_every=128), exact_q)
    unpromoted = rel(tensor_core_gemm(qa, qb, promote_every=None), exact_q)
    assert promoted < unpromoted / 10, (promoted, unpromoted)

    xp, wp = x.abs() + 0.1, w.abs() + 0.1  # activations after SwiGLU-like positive shifts
    qa, qb = quantize_for(xp, r, "input"), quantize_for(wp, r, "weight")
    exact = xp.double() @ wp.double().t()
    promoted = rel(tensor_core_gemm(qa, qb, promote_every=128), exact)
    unpromoted = rel(tensor_core_gemm(qa, qb, promote_every=None), exact)
    assert promoted < 0.6 * unpromoted and promoted < 0.003, (promoted, unpromoted)


# --------------------------------------------------------------------------- Fp8Linear

# Relative (Frobenius) error bounds against FP32, K = 192 (not a multiple of 128), measured
# on seeds 0-2: forward 0.037 for every recipe (E4M3 keeps 3 mantissa bits); gradients 0.059
# with E5M2 gradients ("hybrid": delayed, current), 0.036-0.038 with E4M3 (rowwise,
# blockwise, mxfp8). BF16 autocast is 0.003 on all three.
FWD_BOUND = 0.05
GRAD_BOUND = {"hybrid": 0.075, "e4m3": 0.05}


def _fwd_bwd(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, bf16: bool = False):
    x = x.clone().requires_grad_()
    module.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = module(x)
    y.backward(dy.to(y.dtype))
    return y.float(), x.grad.float(), module.weight.grad.float().clone(), module.bias.grad.clone()


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(192, 80)
    nn.init.normal_(lin.weight, std=0.02, generator=g)
    x, dy = torch.randn(4, 24, 192, generator=g), torch.randn(4, 24, 80, generator=g) * 1e-3
    return lin, x, dy, _fwd_bwd(lin, x, dy)


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_fp8_linear_forward_and_backward_within_bounds(problem, name):
    lin, x, dy, ref = problem
    fp8 = Fp8Linear.from_linear(lin, recipe_from_name(name))
    assert fp8.weight is lin.weight  # same Parameter: names and state dicts unchanged
    for _ in range(2):  # delayed scaling needs a history before its scales fit
        out = _fwd_bwd(fp8, x, dy)
    y, dx, dw, db = out
    grad_bound = GRAD_BOUND[fp8.recipe.fp8_format]
    assert rel(y, ref[0]) < FWD_BOUND
    assert rel(dx, ref[1]) < grad_bound and rel(dw, ref[2]) < grad_bound
    assert torch.allclose(db, ref[3])  # the bias gradient stays in high precision
    assert rel(y, ref[0]) > 5 * rel(_fwd_bwd(lin, x, dy, bf16=True)[0], ref[0])  # really FP8
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp8(x).dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["current", "blockwise"])
def test_fp8_activation_storage(problem, name):
    lin, x, dy, ref = problem
    plain = _fwd_bwd(Fp8Linear.from_linear(lin, recipe_from_name(name)), x, dy)
    stored = _fwd_bwd(Fp8Linear.from_linear(lin, recipe_from_name(name), True), x, dy)
    assert torch.equal(plain[0], stored[0]) and torch.equal(plain[1], stored[1])
    if name == "current":  # per-tensor: wgrad always used the FP8 copy
        assert torch.equal(plain[2], stored[2])
    else:  # re-tiled from FP8: a second rounding, still within the bound
        assert rel(stored[2], ref[2]) < GRAD_BOUND["e4m3"]


def test_autocast_context_overrides_and_disables(problem):
    lin, x, _, _ = problem
    fp8 = Fp8Linear.from_linear(lin, CurrentScaling())
    with fp8_autocast(enabled=False):
        assert torch.equal(fp8(x), lin(x))
    with fp8_autocast(RowwiseScaling()):
        y = fp8(x)
    assert torch.equal(y, Fp8Linear.from_linear(lin, RowwiseScaling())(x))
    with fp8_autocast(DelayedScaling()), pytest.raises(ValueError, match="amax-history"):
        fp8(x)


def test_delayed_state_is_module_state(problem):
    lin, x, dy, _ = problem
    fp8 = Fp8Linear.from_linear(lin, DelayedScaling(amax_history_len=4))
    _fwd_bwd(fp8, x, dy)
    _fwd_bwd(fp8, x, dy)
    sd = fp8.state_dict()
    assert sd["fp8_amax_history"].shape == (4, 3) and sd["fp8_scale"].shape == (3,)
    assert sd["fp8_scale"][0] == pytest.approx(448 / x.abs().max().item())  # input column
    other = Fp8Linear.from_linear(nn.Linear(192, 80), DelayedScaling(amax_history_len=4))
    other.load_state_dict(sd)
    assert torch.equal(other.fp8_scale, fp8.fp8_scale)
    other.load_state_dict(lin.state_dict())  # a plain nn.Linear state dict still loads
    model = nn.Sequential(fp8)
    saved = fp8_state_dict(model)
    assert set(saved) == {"0.fp8_amax_history", "0.fp8_scale"}
    fp8.reset_fp8_state()
    load_fp8_state_dict(model, saved)
    assert torch.equal(fp8.fp8_scale, saved["0.fp8_scale"])
    with pytest.raises(KeyError, match="missing"):
        load_fp8_state_dict(model, {})


def test_grouped_linear_matches_per_expert_linears():
    torch.manual_seed(0)
    grouped = Fp8GroupedLinear(3, 64, 40, bias=True, recipe=DelayedScaling(amax_history_len=2))
    x = torch.randn(10, 64, requires_grad=True)
    y = grouped(x, torch.tensor([4, 0, 6]))  # expert 1 gets no tokens
    y.square().sum().backward()
    assert y.shape == (10, 40) and torch.all(grouped.weight.grad[1] == 0)
    # The idle expert's turn, as TE takes an empty split: its weight's amax recorded, amax 0
    # for its empty input and output gradient, its unit scales kept.
    idle = grouped.fp8_amax_history[:, 3:6]
    assert idle[0, 1] == grouped.weight[1].abs().max() and idle[:, [0, 2]].eq(0).all()
    assert torch.all(grouped.fp8_scale[3:6] == 1)
    for g, rows in ((0, slice(0, 4)), (2, slice(4, 10))):
        single = Fp8Linear(64, 40, recipe=DelayedScaling(amax_history_len=2))
        with torch.no_grad():
            single.weight.copy_(grouped.weight[g])
            single.bias.copy_(grouped.bias[g])
        assert torch.equal(single(x[rows]), y[rows])
    with pytest.raises(ValueError, match="3 entries summing to the 10 tokens"):
        grouped(x, [5, 5])


def test_convert_keeps_configured_layers():
    from hyperloom.config import ModelConfig
    from hyperloom.models.registry import build_model

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128)
    model = build_model(cfg)  # on the meta device, as parallelize builds it
    names = {n for n, _ in model.named_parameters()}
    converted = convert_to_fp8(model, BlockwiseScaling(), keep=DEFAULT_KEEP)
    assert len(converted) == 2 * 7 and "output" not in converted
    assert isinstance(model.get_submodule("layers.0.feed_forward.w2"), Fp8Linear)
    assert type(model.output) is nn.Linear
    assert {n for n, _ in model.named_parameters()} == names
    assert list(PrecisionConfig().fp8_keep) == list(DEFAULT_KEEP)  # config default = engine's
    model2 = build_model(cfg)
    convert_to_fp8(model2, CurrentScaling(), keep=[*DEFAULT_KEEP, "*.attention.*"])
    assert type(model2.get_submodule("layers.0.attention.wq")) is nn.Linear
    assert isinstance(model2.get_submodule("layers.0.feed_forward.w1"), Fp8Linear)


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_tiny_fp8_training_run(tmp_path, tiny_job_args, recipe):
    from hyperloom.config import load_config
    from hyperloom.train.trainer import Trainer

    args = tiny_job_args(tmp_path / recipe, precision__fp8=recipe, train__steps=5)
    trainer = Trainer(load_config(None, [*args, "--train.eval_batches", "2"]))
    assert sum(isinstance(m, Fp8Linear) for m in trainer.model.modules()) == 2 * 7
    summary = trainer.run().summary
    assert math.isfinite(summary["final_train_loss"]) and math.isfinite(summary["final_val_loss"])
    assert summary["final_val_loss"] < summary["initial_val_loss"]


def test_materialize_gives_fp8_linears_fresh_scaling_state():
    """A model converted to FP8 on the meta device and then materialised starts delayed
    scaling from empty histories and unit scales, not from what to_empty left in memory (a
    benchmark that skipped the reset got NaN outputs on its first step)."""
    cfg = ModelConfig(n_layers=1)
    model = build_model(cfg)
    convert_to_fp8(model, recipe_from_name("delayed"))
    model.materialize(torch.device("cpu"), seed=0)
    buffers = dict(model.named_buffers())
    hist = [b for n, b in buffers.items() if n.endswith("fp8_amax_history")]
    scales = [b for n, b in buffers.items() if n.endswith("fp8_scale")]
    assert hist and len(hist) == len(scales) == 7  # q, k, v, o, w1, w2, w3
    assert all(torch.equal(h, torch.zeros_like(h)) for h in hist)
    assert all(torch.equal(s, torch.ones_like(s)) for s in scales)
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    assert torch.isfinite(model(x)).all()


def test_grouped_blockwise_keeps_small_experts_in_their_own_blocks():
    """Experts with fewer rows than a 128 x 128 weight block: padding each expert to a whole
    block keeps a large expert's amax out of a small one's scale (it once shared a block)."""
    torch.manual_seed(0)
    w = torch.randn(2, 64, 256)
    w[1] *= 100  # expert 1's block amax would squeeze expert 0 into a few FP8 values
    w.requires_grad_(True)
    x = torch.randn(8, 256, requires_grad=True)
    out = {}
    for grouped in (True, False):
        y = fp8_grouped_linear(x, w, [4, 4], BlockwiseScaling(), grouped=grouped)
        dx, dw = torch.autograd.grad(y.square().sum(), (x, w))
        out[grouped] = (y, dx, dw)
    for a, b in zip(out[True], out[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
