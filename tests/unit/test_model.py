"""Tests for the Llama family: exact accounting, HF parity, RoPE, init, KV cache, sampling."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hyperloom.config import ModelConfig, preset_config, preset_names
from hyperloom.engine.ops.rope import apply_rope, rope_inv_freq, rope_tables
from hyperloom.inference import filter_logits, generate
from hyperloom.models.llama import KVCache, param_count, training_flops_per_token
from hyperloom.models.llama.hf import from_hf_state_dict, hf_config, to_hf_state_dict
from hyperloom.models.registry import build_model, init_model

transformers = pytest.importorskip("transformers")

SMALL = ModelConfig(
    vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256
)


def analytic_params(c: ModelConfig) -> int:
    """Parameters of a Llama block stack, written out matrix by matrix."""
    head_dim = c.dim // c.n_heads
    wq = c.dim * c.n_heads * head_dim
    wk = wv = c.dim * c.n_kv_heads * head_dim
    wo = c.n_heads * head_dim * c.dim
    w1 = w3 = c.dim * c.ffn_dim
    w2 = c.ffn_dim * c.dim
    norms = 2 * c.dim  # attention_norm, ffn_norm
    norms += 2 * head_dim if c.qk_norm else 0  # q_norm, k_norm: one head_dim weight each
    block = wq + wk + wv + wo + w1 + w2 + w3 + norms
    embedding = c.vocab_size * c.dim
    head = 0 if c.tie_embeddings else c.vocab_size * c.dim
    return c.n_layers * block + c.dim + embedding + head  # + final norm


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- accounting


def test_preset_names():
    assert preset_names() == [
        "tiny",
        "deepseek-v3",
        "deepseek-v2-lite",
        "moe-tiny",
        "quickstart",
        "llama3-8b",
        "llama3-70b",
        "llama3-405b",
        "llava-1.5-7b",
        "vlm-tiny",
    ]


@pytest.mark.parametrize("name", [n for n in preset_names() if preset_config(n).family == "llama"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk-norm"])
def test_param_count_matches_meta_model_and_formula(name, tied, qk_norm):
    cfg = dataclasses.replace(preset_config(name), tie_embeddings=tied, qk_norm=qk_norm)
    model = build_model(cfg)  # meta device: no storage even for 405B
    assert all(p.is_meta for p in model.parameters())
    assert numel(model) == param_count(cfg) == analytic_params(cfg)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        ("llama3-405b", 405_853_388_800),
        ("tiny", 22_025_088),
        ("quickstart", 7_342_336),
    ],
)
def test_released_model_sizes(name, expected):
    cfg = preset_config(name)
    assert param_count(cfg) == expected
    assert numel(build_model(cfg)) == expected


def test_param_count_agrees_with_transformers():
    cfg = preset_config("llama3-8b")
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_config(cfg))
    assert numel(hf) == 8_030_261_248


def test_training_flops_per_token_by_hand():
    cfg = preset_config("llama3-8b")
    L, d, s, V, f = 32, 4096, 8192, 128256, 14336
    head_dim, h, kv = 128, 32, 8
    matmul_weights = L * (d * h * head_dim * 2 + d * kv * head_dim * 2 + 3 * d * f) + V * d
    assert matmul_weights == 7_504_658_432
    expected = 6 * matmul_weights + 12 * L * s * d
    assert expected == 57_912_852_480
    assert training_flops_per_token(cfg, s) == expected
    # Attention FLOPs grow linearly with the sequence length, matmul FLOPs do not.
    delta = training_flops_per_token(cfg, 2 * s) - training_flops_per_token(cfg, s)
    assert delta == 12 * L * s * d
    # A tied output head still does its matmul: same FLOPs, fewer parameters.
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    assert training_flops_per_token(tied, s) == expected
    assert param_count(cfg) - param_count(tied) == V * d


# --------------------------------------------------------------------------- HF parity


def _random_hf(cfg: ModelConfig, seed: int = 1):
    """A transformers Llama whose every parameter is N(0, 0.1): differences cannot hide."""
    hf = transformers.LlamaForCausalLM(hf_config(cfg)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return hf


def _ours_from_hf(hf, cfg: ModelConfig):
    model = build_model(cfg).materialize(torch.device("cpu"), seed=0).eval()
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    return model


PARITY = {
    "untied": SMALL,
    "tied": dataclasses.replace(SMALL, tie_embeddings=True),
    # Positions up to 199 lie far beyond rope_original_max_seq, so the scaled band is used.
    "llama31_rope": dataclasses.replace(
        SMALL, rope_theta=10000.0, rope_scaling=8.0, rope_original_max_seq=64
    ),
}


@pytest.mark.parametrize("case", sorted(PARITY))
def test_hf_to_hyperloom_logits_match(case):
    cfg = PARITY[case]
    hf = _random_hf(cfg)
    ours = _ours_from_hf(hf, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == (2, 200, cfg.vocab_size)
    assert expected.abs().max() > 0.1  # the comparison is not between near-zero tensors
    assert (got - expected).abs().max().item() <= 1e-5


def test_rope_tables_match_transformers_beyond_original_context():
    cfg = PARITY["llama31_rope"]
    hf = _random_hf(cfg)
    ours = _ours_from_hf(hf, cfg)
    positions = torch.arange(200)[None]
    hf_cos, hf_sin = hf.model.rotary_emb(torch.zeros(1, 200, cfg.dim), positions)
    torch.testing.assert_close(ours.rope_cos[:200], hf_cos[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.rope_sin[:200], hf_sin[0], atol=1e-5, rtol=0)
    # Guard for the parity test: with unscaled RoPE the logits must NOT match. Measured
    # difference 3.7e-4, i.e. 37x the parity tolerance of 1e-5.
    unscaled = _ours_from_hf(hf, dataclasses.replace(cfg, rope_scaling=1.0))
    tokens = torch.randint(0, cfg.vocab_size, (1, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (hf(tokens).logits - unscaled(tokens)).abs().max().item()
    assert diff > 1e-4
    assert not torch.allclose(unscaled.rope_cos[:200], hf_cos[0], atol=1e-2)


@pytest.mark.parametrize("tied", [False, True])
def test_hyperloom_to_hf_logits_match(tied):
    cfg = dataclasses.replace(SMALL, tie_embeddings=tied, init_std=0.1)
    ours = init_model(cfg, "cpu", seed=3).eval()
    hf = transformers.LlamaForCausalLM(hf_config(cfg)).eval()
    state = to_hf_state_dict(ours.state_dict())
    if tied:
        # A tied checkpoint has no lm_head.weight (as HF's save_pretrained writes it);
        # the head is the embedding, which is all that may be missing.
        result = hf.load_state_dict(state, strict=False)
        assert result.missing_keys == ["lm_head.weight"] and result.unexpected_keys == []
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    else:
        hf.load_state_dict(state, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 120), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert expected.abs().max() > 0.1
    assert (got - expected).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------- RoPE


def meta_apply_scaling(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's `apply_scaling` from the Llama 3.1 reference code, element by element."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


def test_rope_inv_freq_unscaled():
    inv = rope_inv_freq(16, 10000.0)
    expected = torch.tensor([1.0 / 10000.0 ** (2 * i / 16) for i in range(8)], dtype=torch.float64)
    assert inv.dtype == torch.float64 and inv.shape == (8,)
    torch.testing.assert_close(inv, expected, rtol=1e-15, atol=0)
    assert inv[0].item() == 1.0
    # scaling = 1 disables Llama-3.1 scaling whatever the other factors are.
    torch.testing.assert_close(rope_inv_freq(16, 10000.0, 1.0, 2.0, 8.0, 16), expected)


def test_rope_inv_freq_llama31_matches_meta_and_transformers():
    cfg = preset_config("llama3-8b")  # head_dim 128, theta 5e5, factor 8, 1/4, 8192
    head_dim = cfg.dim // cfg.n_heads
    ours = rope_inv_freq(head_dim, cfg.rope_theta, 8.0, 1.0, 4.0, 8192)
    plain = rope_inv_freq(head_dim, cfg.rope_theta)
    reference = meta_apply_scaling(plain, 8.0, 1.0, 4.0, 8192)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=0)
    # All three regimes occur: kept, divided by the factor, and interpolated in between.
    ratio = plain / ours
    kept = torch.isclose(ratio, torch.tensor(1.0, dtype=torch.float64))
    divided = torch.isclose(ratio, torch.tensor(8.0, dtype=torch.float64))
    between = ~kept & ~divided
    assert kept.sum() > 0 and divided.sum() > 0 and between.sum() > 0
    assert ((ratio[between] > 1) & (ratio[between] < 8)).all()

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_inv, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config(cfg), "cpu")
    assert attention_factor == 1.0
    torch.testing.assert_close(ours.float(), hf_inv.float(), rtol=1e-6, atol=0)


def test_rope_tables_and_relative_position():
    inv = rope_inv_freq(8, 100.0)
    cos, sin = rope_tables(inv, 32)
    assert cos.shape == sin.shape == (32, 8) and cos.dtype == torch.float32
    pos = torch.arange(32, dtype=torch.float64)[:, None]
    torch.testing.assert_close(cos[:, :4].double(), torch.cos(pos * inv), atol=1e-7, rtol=0)
    torch.testing.assert_close(sin[:, 4:].double(), torch.sin(pos * inv), atol=1e-7, rtol=0)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 8, generator=gen)
    k = torch.randn(1, 1, 1, 8, generator=gen)

    def score(m: int, n: int) -> float:
        qm = apply_rope(q, cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k, cos[n : n + 1], sin[n : n + 1])
        return (qm * kn).sum().item()

    # The score depends only on the distance m - n (Su et al., eq. 11), not on m itself.
    assert score(5, 2) == pytest.approx(score(20, 17), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)
    # A rotation keeps the norm.
    rotated = apply_rope(q, cos[7:8], sin[7:8])
    assert rotated.norm().item() == pytest.approx(q.norm().item(), rel=1e-6)


# --------------------------------------------------------------------------- init


def test_init_is_deterministic_in_the_seed():
    a = init_model(SMALL, "cpu", seed=7).state_dict()
    b = init_model(SMALL, "cpu", seed=7).state_dict()
    c = init_model(SMALL, "cpu", seed=8).state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(a[name], c[name]), name


def test_meta_build_then_materialize():
    model = build_model(SMALL)
    assert all(p.is_meta for p in model.parameters()) and model.rope_cos.is_meta
    model.materialize(torch.device("cpu"), seed=7)
    assert not any(p.is_meta for p in model.parameters())
    cos, sin = rope_tables(rope_inv_freq(16, SMALL.rope_theta), SMALL.max_seq_len)
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    reference = init_model(SMALL, "cpu", seed=7)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
    logits = model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()


def test_init_statistics():
    cfg = ModelConfig(vocab_size=1024, dim=256, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=512)
    model = init_model(cfg, "cpu", seed=0)
    params = dict(model.named_parameters())
    out_std = 0.02 / math.sqrt(2 * 8)  # 0.005: GPT-2's residual scaling
    for name, p in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        expected = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
        # >= 32k samples each: the sample std is within 2 % of the true one.
        assert p.std().item() == pytest.approx(expected, rel=0.05), name
        assert abs(p.mean().item()) < expected * 0.05, name
    assert (
        params["layers.3.attention.wo.weight"].std()
        < 0.5 * params["layers.3.attention.wq.weight"].std()
    )
    assert params["layers.3.feed_forward.w2.weight"].std() < 0.5 * params["layers.3.feed_forward.w1.weight"].std()  # fmt: skip


# --------------------------------------------------------------------------- KV cache


@pytest.fixture(scope="module", params=[False, True], ids=["", "qk-norm"])
def random_model(request):
    cfg = dataclasses.replace(SMALL, max_seq_len=64, init_std=0.1, qk_norm=request.param)
    model = init_model(cfg, "cpu", seed=0).eval()
    if request.param:  # norm weights away from one: the cached keys must be the normed ones
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 3.0, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_kv_cache_prefill_decode_and_chunk_match_full_forward(random_model):
    cfg = random_model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = random_model(tokens)
        cache = KVCache.allocate(cfg, 2, 40, torch.device("cpu"), torch.float32)
        parts = [random_model(tokens[:, :16], cache=cache, start_pos=0)]  # prefill
        for pos in range(16, 24):  # one token at a time
            parts.append(random_model(tokens[:, pos : pos + 1], cache=cache, start_pos=pos))
        # A block of 16 new tokens after a cached prefix: the explicit-mask path.
        parts.append(random_model(tokens[:, 24:40], cache=cache, start_pos=24))
        incremental = torch.cat(parts, dim=1)
    assert cache.max_len == 40
    assert full.abs().max() > 1.0
    assert (incremental - full).abs().max().item() <= 1e-5


def test_chunk_after_prefix_is_causal_within_the_chunk(random_model):
    """Changing the last token of a chunk must not change the earlier positions' logits."""
    cfg = random_model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(6))
    altered = tokens.clone()
    altered[0, -1] = (altered[0, -1] + 1) % cfg.vocab_size
    outs = []
    with torch.no_grad():
        for seq in (tokens, altered):
            cache = KVCache.allocate(cfg, 1, 20, torch.device("cpu"), torch.float32)
            random_model(seq[:, :8], cache=cache, start_pos=0)
            outs.append(random_model(seq[:, 8:], cache=cache, start_pos=8))
    assert torch.equal(outs[0][:, :-1], outs[1][:, :-1])
    assert not torch.allclose(outs[0][:, -1], outs[1][:, -1])


def test_forward_rejects_positions_beyond_max_seq_len(random_model):
    with pytest.raises(ValueError, match=r"positions 60\.\.64 exceed model\.max_seq_len \(64\)"):
        random_model(torch.zeros(1, 5, dtype=torch.long), start_pos=60)


def test_greedy_generation_same_with_and_without_cache(random_model):
    prompt = [1, 2, 3, 4, 5]
    cached = generate(random_model, prompt, 40, temperature=0, use_cache=True)
    uncached = generate(random_model, prompt, 40, temperature=0, use_cache=False)
    assert len(cached) == 40
    assert len(set(cached)) > 5  # not a degenerate constant stream
    assert cached == uncached


def test_sampling_is_reproducible_from_the_seed(random_model):
    a = generate(random_model, [7, 8], 30, temperature=1.0, top_k=0, seed=11)
    b = generate(random_model, [7, 8], 30, temperature=1.0, top_k=0, seed=11)
    c = generate(random_model, [7, 8], 30, temperature=1.0, top_k=0, seed=12)
    assert a == b and a != c


def test_generate_stops_at_eos_and_at_max_seq_len(random_model):
    first = generate(random_model, [1, 2, 3], 1, temperature=0)[0]
    assert generate(random_model, [1, 2, 3], 20, temperature=0, eos_id=first) == [first]
    prompt = list(range(61))
    assert len(generate(random_model, prompt, 10, temperature=0)) == 3  # 61 + 3 = 64


def test_generate_rejects_bad_prompts(random_model):
    with pytest.raises(ValueError, match="zero tokens"):
        generate(random_model, [], 5)
    with pytest.raises(ValueError, match="the prompt has 64 tokens; the model's limit is 64"):
        generate(random_model, list(range(64)), 5)


# --------------------------------------------------------------------------- filter_logits


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0, -1.0], [0.0, -2.0, 7.0, 1.0, 6.0, 3.0]])
    out = filter_logits(logits, top_k=3)
    kept = torch.isfinite(out)
    assert kept.sum(dim=-1).tolist() == [3, 3]
    assert kept[0].nonzero().flatten().tolist() == [1, 2, 3]
    assert kept[1].nonzero().flatten().tolist() == [2, 4, 5]
    assert torch.equal(out[kept], logits[kept])  # survivors are untouched
    assert torch.equal(filter_logits(logits, top_k=0), logits)  # 0 = off
    assert torch.equal(filter_logits(logits, top_k=6), logits)


@pytest.mark.parametrize(
    ("top_p", "kept_probs"),
    [
        (0.45, [0.5]),  # the top token alone already reaches 0.45
        (0.6, [0.5, 0.2]),  # 0.5 < 0.6 <= 0.7
        (0.8, [0.5, 0.2, 0.15]),  # 0.7 < 0.8 <= 0.85
        (0.9, [0.5, 0.2, 0.15, 0.1]),  # 0.85 < 0.9 <= 0.95
        (0.99, [0.5, 0.2, 0.15, 0.1, 0.05]),
    ],
)
def test_top_p_keeps_the_minimal_set_reaching_p(top_p, kept_probs):
    probs = torch.tensor([0.1, 0.5, 0.05, 0.2, 0.15])  # shuffled so order is tested too
    out = filter_logits(probs.log(), top_p=top_p)
    kept = torch.isfinite(out)
    assert sorted(probs[kept].tolist(), reverse=True) == pytest.approx(kept_probs)
    # Sampling renormalises over the survivors.
    renorm = out.softmax(dim=-1)[kept]
    torch.testing.assert_close(renorm, probs[kept] / sum(kept_probs))


def test_top_k_then_top_p():
    probs = torch.tensor([0.1, 0.5, 0.05, 0.2, 0.15])
    # top-p acts on the renormalised top-k distribution [0.5, 0.2] / 0.7 = [0.714, 0.286].
    out = filter_logits(probs.log(), top_k=2, top_p=0.75)
    assert torch.isfinite(out).nonzero().flatten().tolist() == [1, 3]
    out = filter_logits(probs.log(), top_k=2, top_p=0.7)
    assert torch.isfinite(out).nonzero().flatten().tolist() == [1]
