"""benchmarks/fp8_gradient_fidelity.py's attention probe: the logits it reads are the ones the
model attends with (RoPE, grouped-query heads, causal mask), and its distances are zero for equal
attention and count a changed most-attended key."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from hyperloom.accelerator import get_accelerator
from hyperloom.config import preset_config
from hyperloom.engine.fp8 import BlockwiseScaling, convert_to_fp8
from hyperloom.models.registry import init_model

BENCHMARK = "fp8_gradient_fidelity"  # the conftest `bench` fixture imports it


def _trainer(model, inputs):
    return SimpleNamespace(
        model=model,
        fwd=model,
        val=[(inputs, inputs)],
        acc=get_accelerator("cpu"),
        dtype=torch.float32,
    )


def _tiny(qk_norm=False):
    cfg = replace(
        preset_config("tiny"), dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
        vocab_size=97, max_seq_len=64, qk_norm=qk_norm,
    )  # fmt: skip
    torch.manual_seed(0)
    model = init_model(cfg, "cpu", seed=0)
    if qk_norm:  # norm weights away from one, so a probe that skips the norms shows
        with torch.no_grad():
            for layer in model.layers.values():
                layer.attention.q_norm.weight.uniform_(0.5, 3.0)
                layer.attention.k_norm.weight.uniform_(0.5, 3.0)
    return model, torch.randint(0, 97, (2, 24))


@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk-norm"])
def test_logits_are_the_ones_the_model_attends_with(bench, qk_norm):
    model, inputs = _tiny(qk_norm)
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def keep(i, what):
        def hook(_mod, args, out):
            seen.setdefault(i, {})[what] = (args[0] if what == "o_in" else out).detach()

        return hook

    for i, layer in enumerate(model.layers.values()):
        layer.attention.wv.register_forward_hook(keep(i, "v"))
        layer.attention.wo.register_forward_hook(keep(i, "o_in"))
    logits = bench.attention_logits(_trainer(model, inputs))
    assert len(logits) == 2
    for i, s in enumerate(logits):
        b, h, n, _ = s.shape
        assert (b, h, n) == (2, 4, 24)
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        assert torch.isinf(s[..., future]).all() and torch.isfinite(s[..., ~future]).all()
        v = seen[i]["v"].unflatten(-1, (-1, 16)).transpose(1, 2)  # (b, kv, s, d)
        v = v.repeat_interleave(2, dim=1)
        out = (s.softmax(-1) @ v).transpose(1, 2).flatten(2)
        torch.testing.assert_close(out, seen[i]["o_in"], atol=1e-5, rtol=1e-4)


def test_fp8_forward_moves_attention_and_fp32_does_not(bench):
    model, inputs = _tiny()
    ref = bench.attention_logits(_trainer(model, inputs))
    same = bench.attention_shift(bench.attention_logits(_trainer(model, inputs)), ref)
    assert same["mean"] == {"logit_err_rms": 0.0, "attn_tv": 0.0, "argmax_flips": 0.0}
    recipe = BlockwiseScaling()
    assert convert_to_fp8(model, recipe)  # in place
    moved = bench.attention_shift(bench.attention_logits(_trainer(model, inputs), recipe), ref)
    assert moved["mean"]["logit_err_rms"] > 1e-4
    assert 0 < moved["mean"]["attn_tv"] < 0.5


def test_distances_by_hand(bench):
    ninf = float("-inf")
    ref = [torch.tensor([[[[0.0, ninf], [2.0, 0.0]]]])]  # one layer, one head, two queries
    new = [torch.tensor([[[[0.0, ninf], [0.0, 2.0]]]])]  # the second query's winner changes
    r = bench.attention_shift(new, ref)["layers"][0]
    p = torch.tensor([2.0, 0.0]).softmax(0)
    assert r["argmax_flips"] == pytest.approx(0.5)
    assert r["attn_tv"] == pytest.approx((0.0 + (p[0] - p[1]).abs().item()) / 2)
    assert r["logit_err_rms"] == pytest.approx((8 / 3) ** 0.5)  # (0, 2, -2) over 3 entries
    assert bench.logit_scale(ref) == [{"amax": 2.0, "std": pytest.approx(1.1547, abs=1e-4)}]
