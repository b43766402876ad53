"""The vision-language family on one device: shapes, the image merge, the loss, freezing,
recompute, cached generation and the errors bad inputs get."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hyperloom.config import preset_config
from hyperloom.config.models.vlm import tokens_per_image
from hyperloom.engine.ops import OpImpls, use_ops
from hyperloom.inference.generate import generate
from hyperloom.models.freeze import apply_freeze, freeze_problems, frozen_names
from hyperloom.models.registry import build_model, family, init_model
from hyperloom.models.vlm import ImageTokens
from hyperloom.models.vlm.plan import VISION_RECOMPUTE_PLAN
from hyperloom.parallel.recompute import apply_recompute


def tiny(**kw):
    cfg = preset_config("vlm-tiny")
    return dataclasses.replace(cfg, **kw)


def model_of(cfg, seed=0):
    m = init_model(cfg, "cpu", seed)
    use_ops(m, OpImpls.choose(fused=False))
    return m


def batch(cfg, rows_images=(1, 0, 2), seq=48, seed=0):
    """Token rows with `n` images each, placed after a few text tokens."""
    g = torch.Generator().manual_seed(seed)
    per = tokens_per_image(cfg)
    tokens = torch.randint(0, cfg.image_token_id, (len(rows_images), seq), generator=g)
    for b, n in enumerate(rows_images):
        for i in range(n):
            start = 2 + i * (per + 1)
            tokens[b, start : start + per] = cfg.image_token_id
    slots = max(rows_images)
    images = torch.randn(
        len(rows_images), max(slots, 1), 3, cfg.image_size, cfg.image_size, generator=g
    )
    return ImageTokens(tokens, images)


@pytest.mark.parametrize("preset", ["vlm-tiny", "llava-1.5-7b"])
def test_param_count_matches_the_built_model(preset):
    cfg = preset_config(preset)
    built = sum(p.numel() for p in build_model(cfg).parameters())
    assert family("vlm").param_count(cfg) == built


def test_llava_7b_has_the_published_parameter_count():
    # llava-hf/llava-1.5-7b-hf: 7,063,427,072 parameters
    assert family("vlm").param_count(preset_config("llava-1.5-7b")) == 7_063_427_072


def test_image_features_replace_their_placeholders_in_order():
    cfg = tiny()
    m = model_of(cfg)
    x = batch(cfg, (1, 0, 2))
    h = m.embed(x, 0)  # (b, s, dim)
    text = m.tok_embeddings(x.tokens)
    slots = x.tokens == cfg.image_token_id
    assert torch.equal(h[~slots], text[~slots])  # text untouched
    used = torch.cat([x.images[0, :1], x.images[2, :2]])  # row order, then slot order
    feats = m.projector(m.vision(used)).flatten(0, 1)
    torch.testing.assert_close(h[slots], feats, rtol=0, atol=0)


def test_text_only_batch_needs_no_images_and_equals_the_decoder():
    cfg = tiny()
    m = model_of(cfg)
    tokens = torch.randint(0, cfg.image_token_id, (2, 20))
    dec = dataclasses.replace(cfg, family="llama")
    # the same decoder weights: names are the decoder's (vision and projector aside)
    llama = build_model(dataclasses.replace(dec, **_vision_defaults())).materialize(
        torch.device("cpu"), 1
    )
    llama.load_state_dict(
        {k: v for k, v in m.state_dict().items() if not k.startswith(("vision.", "projector."))}
    )
    use_ops(llama, OpImpls.choose(fused=False))
    torch.testing.assert_close(m(tokens), llama(tokens), rtol=0, atol=0)


def _vision_defaults():
    from hyperloom.config.models.vlm import VisionFields

    return {f.name: f.default for f in dataclasses.fields(VisionFields)}


def test_sample_mean_loss_weighs_every_sample_alike():
    cfg = tiny()
    m = model_of(cfg)
    x = batch(cfg, (1, 1))
    labels = torch.full_like(x.tokens, -100)
    labels[0, 30:32] = 5  # two answer tokens
    labels[1, 30:40] = 7  # ten
    loss = m(x, labels=labels)
    logits = m(x).float()
    per_row = [
        F.cross_entropy(logits[b][labels[b] != -100], labels[b][labels[b] != -100])
        for b in range(2)
    ]
    torch.testing.assert_close(loss, torch.stack(per_row).mean(), rtol=1e-6, atol=1e-6)


def test_fused_loss_equals_reference_with_sample_mean():
    cfg = tiny()
    m = model_of(cfg)
    x = batch(cfg, (1, 2, 0))
    labels = torch.randint(0, cfg.vocab_size, x.tokens.shape)
    labels[:, :20] = -100
    labels[2, :40] = -100
    ref = m(x, labels=labels)
    use_ops(m, OpImpls.choose(compile=False))
    torch.testing.assert_close(m(x, labels=labels), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("r", [2])
def test_pixel_shuffle_cuts_tokens_per_image(r):
    cfg = tiny(pixel_shuffle=r)
    assert tokens_per_image(cfg) == (cfg.image_size // cfg.patch_size) ** 2 // r**2
    m = model_of(cfg)
    x = batch(cfg, (1, 2), seq=30)
    assert m(x).shape == (2, 30, cfg.vocab_size)


def test_unused_encoder_blocks_are_frozen_and_named():
    cfg = tiny()  # 3 blocks, feature layer -2: block 2 and the final LayerNorm never run
    m = build_model(cfg)
    unused = set(m.unused_parameters())
    assert unused == {
        n
        for n, _ in m.named_parameters()
        if n.startswith(("vision.layers.2.", "vision.post_norm."))
    }
    assert unused <= frozen_names(m, [])


@pytest.mark.parametrize(
    "freeze,trains",
    [
        (["vision", "decoder"], ("projector.",)),
        (["vision"], ("projector.", "layers.", "tok_embeddings.", "norm.", "output.")),
        (["decoder"], ("projector.", "vision.")),
    ],
)
def test_frozen_parts_get_no_gradients(freeze, trains):
    cfg = tiny()
    m = model_of(cfg)
    apply_freeze(m, freeze)
    x = batch(cfg, (1, 2))
    labels = torch.randint(0, cfg.vocab_size, x.tokens.shape)
    m(x, labels=labels).backward()
    unused = set(m.unused_parameters())
    for name, p in m.named_parameters():
        expect = name.startswith(trains) and name not in unused
        assert (p.grad is not None) == expect, name
        assert p.requires_grad == expect, name


def test_freeze_problems_name_what_is_wrong():
    m = build_model(tiny())
    assert "does not have" in freeze_problems(build_model(preset_config("tiny")), ["vision"])[0]
    assert "matches no parameter" in freeze_problems(m, ["nope.*"])[0]
    assert "nothing trains" in freeze_problems(m, ["vision", "projector", "decoder"])[0]
    assert freeze_problems(m, ["vision", "layers.0.*"]) == []


@pytest.mark.parametrize("policy", ["full", "selective", "core_attn,mlp_act,norm"])
def test_encoder_recompute_keeps_gradients(policy):
    cfg = tiny()
    x = batch(cfg, (2, 1))
    labels = torch.randint(0, cfg.vocab_size, x.tokens.shape)
    grads = []
    for recompute in (False, True):
        m = model_of(cfg)
        if recompute:
            assert apply_recompute(m.vision, policy, 0, VISION_RECOMPUTE_PLAN) == cfg.vision_layers
        m(x, labels=labels).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=0, msg=n)


def test_cached_generation_with_an_image_equals_uncached():
    cfg = tiny()
    m = model_of(cfg)
    per = tokens_per_image(cfg)
    prompt = [3, 4] + [cfg.image_token_id] * per + [9, 10, 11]
    image = torch.randn(1, 3, cfg.image_size, cfg.image_size)
    kw = dict(temperature=0.0, top_k=0, images=image)
    cached = generate(m, prompt, 8, **kw)
    plain = generate(m, prompt, 8, use_cache=False, **kw)
    assert cached == plain and len(cached) == 8


def test_bad_inputs_get_clear_errors():
    cfg = tiny()
    m = model_of(cfg)
    x = batch(cfg, (1, 0))
    bad = x.tokens.clone()
    bad[0, 2] = 0  # one placeholder short of an image
    with pytest.raises(ValueError, match="multiple of"):
        m(ImageTokens(bad, x.images))
    two = batch(cfg, (2, 0))
    with pytest.raises(ValueError, match="image slot"):
        m(ImageTokens(two.tokens, two.images[:, :1]))
    with pytest.raises(ValueError, match="no images|image slot"):
        m(two.tokens)
    small = torch.randn(2, 1, 3, 16, 16)
    with pytest.raises(ValueError, match=r"\(3, 32, 32\)"):
        m(ImageTokens(x.tokens, small))


def test_fp8_reaches_the_encoder_and_projector_linears():
    """precision.fp8 converts every linear of the encoder and projector as the decoder's
    (the patch convolution stays in high precision); the loss stays within FP8's rounding of
    the high-precision one and every converted weight gets a finite gradient."""
    from hyperloom.config import load_config
    from hyperloom.engine.fp8 import fp8_autocast
    from hyperloom.engine.fp8.modules import Fp8Linear
    from hyperloom.parallel.fp8 import apply_fp8

    args = ["--model.preset", "vlm-tiny", "--data.source", "scenes", "--data.seq_len", "48"]
    job = load_config(None, [*args, "--precision.fp8", "current", "--precision.dtype", "fp32"])
    m = build_model(job.model)
    apply_fp8(m, job)
    m.materialize(torch.device("cpu"), 0)
    use_ops(m, OpImpls.choose(fused=False))
    fp8 = {n for n, mod in m.named_modules() if isinstance(mod, Fp8Linear)}
    for name in ("vision.layers.0.self_attn.q_proj", "vision.layers.1.mlp.fc2", "projector.linear_1",
                 "projector.linear_2", "layers.0.attention.wq"):  # fmt: skip
        assert name in fp8, name
    x = batch(job.model, (1, 2))
    labels = torch.randint(0, job.model.vocab_size, x.tokens.shape)
    loss = m(x, labels=labels)
    loss.backward()
    with fp8_autocast(enabled=False):
        high = m(x, labels=labels)
    assert abs(loss.item() - high.item()) < 0.02 * high.item()
    unused = set(m.unused_parameters())  # the block above the feature layer: no gradient
    for name in fp8:
        w = m.get_submodule(name).weight
        if f"{name}.weight" not in unused:
            assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0
