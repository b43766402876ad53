"""`override_linear_precision` (TransformerEngine's recipe field): each of an FP8 linear's three
GEMMs (fprop, dgrad, wgrad) can run in high precision while the other two stay FP8.

A GEMM kept in high precision must give what a BF16 layer's GEMM gives (F.linear under the same
autocast), bit for bit, and the GEMMs left in FP8 must give what they give without the override.
Delayed scaling must keep recording the amaxes of what it still quantizes.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyperloom.engine.fp8 import (
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    Fp8Linear,
    MXFP8Scaling,
    RowwiseScaling,
)
from hyperloom.engine.fp8.modules import _grouped_path

RECIPES = [DelayedScaling, CurrentScaling, RowwiseScaling, BlockwiseScaling, MXFP8Scaling]
OVERRIDES = [o for o in itertools.product([False, True], repeat=3) if any(o) and not all(o)]


def _run(recipe, x, w, dy, autocast=True):
    """(y, dx, dW) of one forward/backward of an FP8 linear holding `w`."""
    layer = Fp8Linear.from_linear(nn.Linear(w.shape[1], w.shape[0], bias=False), recipe)
    with torch.no_grad():
        layer.weight.copy_(w)
    xx = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = layer(xx)
    y.backward(dy.to(y.dtype))
    return y, xx.grad, layer.weight.grad, layer


def _bf16(x, w, dy):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        y = F.linear(xx, ww)
    y.backward(dy.to(y.dtype))
    return y, xx.grad, ww.grad


@pytest.mark.parametrize("override", OVERRIDES, ids=lambda o: "".join("HF"[not v] for v in o))
@pytest.mark.parametrize("recipe_cls", RECIPES, ids=lambda c: c.name)
def test_each_overridden_gemm_is_the_bf16_gemm_and_the_rest_stay_fp8(recipe_cls, override):
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(96, 256, generator=g), torch.randn(128, 256, generator=g) * 0.05
    dy = torch.randn(96, 128, generator=g)
    bf16 = _bf16(x, w, dy)
    fp8 = _run(recipe_cls(), x, w, dy)[:3]
    got = _run(recipe_cls(override_linear_precision=override), x, w, dy)[:3]
    for name, hp, out, want_hp, want_fp8 in zip(
        ("y", "dx", "dW"), override, got, bf16, fp8, strict=True
    ):
        want = want_hp if hp else want_fp8
        assert torch.equal(out, want), f"{name} ({'high precision' if hp else 'FP8'})"
    # and the FP8 result really differs from BF16 here, so the comparison above can fail
    assert not any(torch.equal(a, b) for a, b in zip(fp8, bf16, strict=True))


def test_delayed_scaling_still_records_what_it_quantizes():
    g = torch.Generator().manual_seed(2)
    x, w, dy = (
        torch.randn(32, 64, generator=g),
        torch.randn(48, 64, generator=g),
        torch.randn(32, 48, generator=g),
    )
    *_, plain = _run(DelayedScaling(), x, w, dy, autocast=False)
    # The forward GEMM in high precision: the input and weight are still quantized for the
    # FP8 weight- and data-gradient GEMMs, so all three amaxes are recorded as before.
    *_, fwd_hp = _run(
        DelayedScaling(override_linear_precision=(True, False, False)), x, w, dy, False
    )
    assert torch.equal(fwd_hp.fp8_amax_history, plain.fp8_amax_history)
    assert fwd_hp.fp8_amax_history[0].gt(0).all()
    # Both backward GEMMs in high precision: the output gradient is never quantized.
    *_, bwd_hp = _run(
        DelayedScaling(override_linear_precision=(False, True, True)), x, w, dy, False
    )
    hist = bwd_hp.fp8_amax_history[0]  # columns: input, weight, grad_output
    assert torch.equal(hist[:2], plain.fp8_amax_history[0, :2]) and hist[2] == 0


def test_an_override_keeps_experts_off_the_grouped_gemm():
    assert _grouped_path(BlockwiseScaling(), None, False)
    assert not _grouped_path(
        BlockwiseScaling(override_linear_precision=(False, False, True)), None, False
    )


@pytest.mark.parametrize(
    "value,match",
    [
        ((True, True, True), "no GEMM in FP8"),
        ((True, False), "three booleans"),
        ((1, 0, 0), "three booleans"),
    ],
)
def test_bad_override_is_refused_with_the_reason(value, match):
    with pytest.raises(ValueError, match=match):
        BlockwiseScaling(override_linear_precision=value)


def test_the_config_switch_reaches_every_fp8_layer():
    from hyperloom.accelerator import get_accelerator
    from hyperloom.config import load_config
    from hyperloom.engine.fp8.convert import fp8_modules
    from hyperloom.parallel import build_parallel_model
    from hyperloom.parallel.mesh import build_mesh

    cfg = load_config(
        None,
        ["--model.preset", "tiny", "--model.n_layers", "1", "--model.dim", "64",
         "--model.n_heads", "2", "--model.n_kv_heads", "1", "--model.ffn_dim", "128",
         "--model.vocab_size", "256", "--precision.fp8", "blockwise",
         "--precision.fp8_high_precision", '["wgrad"]', "--train.device", "cpu"],
        world_size=1,
    )  # fmt: skip
    acc = get_accelerator("cpu")
    model = build_parallel_model(cfg, build_mesh(cfg.parallel, acc), acc.device).inner
    recipes = {m.recipe for _, m in fp8_modules(model)}
    assert recipes == {BlockwiseScaling(override_linear_precision=(False, False, True))}


@pytest.mark.parametrize(
    "names,match",
    [(["wgard"], "not GEMMs of a linear layer"), (["fprop", "dgrad", "wgrad"], "nothing in FP8")],
)
def test_bad_config_names_are_refused(names, match):
    from hyperloom.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, ["--precision.fp8_high_precision", str(names).replace("'", '"')], 1)


def _tiny_fp8_job(*extra: str):
    from hyperloom.config import load_config

    return load_config(
        None,
        ["--model.preset", "tiny", "--model.n_layers", "4", "--model.dim", "64",
         "--model.n_heads", "2", "--model.n_kv_heads", "1", "--model.ffn_dim", "128",
         "--model.vocab_size", "256", "--precision.fp8", "blockwise", "--train.device", "cpu",
         *extra],
        world_size=1,
    )  # fmt: skip


@pytest.mark.parametrize(
    "first,last,fp8_blocks", [(0, 0, {0, 1, 2, 3}), (1, 1, {1, 2}), (2, 0, {2, 3}), (0, 3, {0})]
)
def test_first_and_last_blocks_stay_high_precision(first, last, fp8_blocks):
    """Megatron's --num-layers-at-start/end-in-bf16: those blocks keep plain linears (every
    one of them), the others convert; embedding and head stay as fp8_keep says."""
    from torch import nn

    from hyperloom.accelerator import get_accelerator
    from hyperloom.engine.fp8.convert import fp8_modules
    from hyperloom.parallel import build_parallel_model
    from hyperloom.parallel.mesh import build_mesh

    cfg = _tiny_fp8_job(
        "--precision.fp8_bf16_first_layers", str(first),
        "--precision.fp8_bf16_last_layers", str(last),
    )  # fmt: skip
    acc = get_accelerator("cpu")
    model = build_parallel_model(cfg, build_mesh(cfg.parallel, acc), acc.device).inner
    converted = {int(name.split(".")[1]) for name, _ in fp8_modules(model)}
    assert converted == fp8_blocks
    for i, block in model.layers.items():
        plain = [n for n, m in block.named_modules() if type(m) is nn.Linear]
        assert bool(plain) == (int(i) not in fp8_blocks), (i, plain)


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--precision.fp8_bf16_first_layers", "-1"], "0 or more"),
        (["--precision.fp8_bf16_first_layers", "2", "--precision.fp8_bf16_last_layers", "2"],
         "keeps all 4 blocks"),
    ],
)  # fmt: skip
def test_bad_layer_counts_are_refused(extra, match):
    from hyperloom.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        _tiny_fp8_job(*extra)
    if "-1" not in extra:  # without fp8 the counts have nothing to keep out of it
        _tiny_fp8_job(*extra, "--precision.fp8", "none")


def test_fp8_activation_switch_saves_the_fp8_copy_instead_of_the_input():
    """precision.fp8_activation: every FP8 linear keeps its input's FP8 copy for backward
    instead of the input. The forward and every data gradient are unchanged (bit for bit:
    the norms' and embedding's gradients too); only FP8 weights' gradients move, where
    re-tiling the FP8 copy (blockwise: 1 x 128 along K to 1 x 128 along tokens) rounds a
    second time -- with power-of-two scales only values pushed below E4M3's normal range
    round again, so some gradients stay bit for bit; and the unique storages saved for
    backward lose at least each SwiGLU down-projection's input, which only it saves."""
    from hyperloom.accelerator import get_accelerator
    from hyperloom.engine.fp8.convert import fp8_modules
    from hyperloom.parallel import build_parallel_model
    from hyperloom.parallel.mesh import build_mesh

    acc = get_accelerator("cpu")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    runs = {}
    for on in (False, True):
        cfg = _tiny_fp8_job("--precision.fp8_activation", str(on).lower())
        model = build_parallel_model(cfg, build_mesh(cfg.parallel, acc), acc.device).inner
        fp8 = dict(fp8_modules(model))
        assert fp8 and all(m.fp8_activation is on for m in fp8.values())
        saved: dict[int, int] = {}

        def pack(t, saved=saved):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens, labels=tokens)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        runs[on] = loss, grads, {f"{n}.weight" for n in fp8}, sum(saved.values())
    (loss0, g0, fp8_weights, bytes0), (loss1, g1, _, bytes1) = runs[False], runs[True]
    assert torch.equal(loss0, loss1)
    for name, g in g0.items():
        if name in fp8_weights:
            assert (g1[name] - g).norm() <= 0.1 * g.norm(), name
        else:
            assert torch.equal(g, g1[name]), name
    moved = [n for n in fp8_weights if not torch.equal(g0[n], g1[n])]
    assert moved, "no weight gradient came from the FP8 copy"
    down_inputs = 4 * 2 * 32 * 128 * 4  # layers x tokens x ffn_dim x fp32 bytes
    assert bytes0 - bytes1 >= down_inputs, (bytes0, bytes1)
