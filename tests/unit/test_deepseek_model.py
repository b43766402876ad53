"""DeepSeek family: logits equal transformers' DeepseekV3ForCausalLM (group-limited routing with
the bias, YaRN, low-rank queries), MLA absorbed decode, experts' grouped GEMM, HF round trip."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hyperloom.config import ModelConfig, preset_config
from hyperloom.engine.ops import OpImpls
from hyperloom.inference import generate
from hyperloom.models.deepseek import hf
from hyperloom.models.deepseek.moe import MoE
from hyperloom.models.registry import init_model

EAGER = OpImpls.choose(compile=False)  # same arithmetic as the compiled kernels, no compiling


def small(**overrides) -> ModelConfig:
    """A few-layer V3-shaped model: 1 dense + 2 MoE layers, 8 experts in 4 groups."""
    base = dataclasses.replace(
        preset_config("moe-tiny"),
        vocab_size=128,
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=96,
        n_routed_experts=8,
        moe_top_k=3,
        moe_ffn_dim=32,
        moe_n_groups=4,
        moe_topk_groups=2,
        moe_route_scale=2.5,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_scaling=4.0,
        rope_original_max_seq=16,
        yarn_mscale=0.707,
        max_seq_len=64,
        mtp_depth=1,
    )
    return dataclasses.replace(base, **overrides)


def build(cfg: ModelConfig, seed: int = 0):
    model = init_model(cfg, "cpu", seed).use_ops(EAGER)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a bias large enough to change which experts are chosen
        for m in model.moe_layers().values():
            m.router.expert_bias.copy_(torch.randn(cfg.n_routed_experts, generator=gen) * 0.05)
    return model.eval()


def hf_model(cfg: ModelConfig, state: dict[str, torch.Tensor]):
    transformers = pytest.importorskip("transformers")
    ref = transformers.DeepseekV3ForCausalLM(hf.hf_config(cfg)).eval()
    ref.load_state_dict(
        {k: v for k, v in hf.to_hf_state_dict(state, cfg).items() if "layers.3." not in k}
    )
    return ref


@pytest.mark.parametrize("q_lora_rank", [24, 0])
def test_logits_equal_transformers(q_lora_rank):
    cfg = small(q_lora_rank=q_lora_rank)
    model = build(cfg)
    ref = hf_model(cfg, model.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(tokens), ref(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    # The bias took part: without it, some token would pick other experts.
    moe = model.layers["1"].feed_forward
    h = torch.randn(48, cfg.dim, generator=torch.Generator().manual_seed(4))
    with_bias = moe.router(h).experts.sort(-1).values
    with torch.no_grad():
        moe.router.expert_bias.zero_()
    assert not torch.equal(with_bias, moe.router(h).experts.sort(-1).values)


def test_group_limit_keeps_experts_in_topk_groups():
    cfg = small(moe_top_k=4)
    router = build(cfg).layers["1"].feed_forward.router
    x = torch.randn(64, cfg.dim, generator=torch.Generator().manual_seed(5))
    groups = router(x).experts // (cfg.n_routed_experts // cfg.moe_n_groups)  # (T, k)
    assert max(len(set(row.tolist())) for row in groups) <= cfg.moe_topk_groups
    assert max(len(set(row.tolist())) for row in groups) == cfg.moe_topk_groups


def test_grouped_mm_equals_expert_loop_and_capacity_drops():
    cfg = small()
    model = build(cfg).train()
    moe: MoE = model.layers["1"].feed_forward
    x = torch.randn(2, 16, cfg.dim, generator=torch.Generator().manual_seed(6), requires_grad=True)
    outs, grads = [], []
    for use in (True, False):
        moe.experts.grouped_mm = use
        y = moe(x)
        (gx,) = torch.autograd.grad(y.square().sum(), x)
        outs.append(y)
        grads.append(gx)
    assert (outs[0] - outs[1]).abs().max() < 1e-5 and (grads[0] - grads[1]).abs().max() < 1e-5
    # Capacity 0.5: each expert takes at most ceil(0.5 * 32 * 3 / 8) = 6 assignments.
    capped = MoE(dataclasses.replace(cfg, moe_capacity_factor=0.5))
    capped.load_state_dict(moe.state_dict())
    assert capped.capacity(32) == 6
    y = capped(x)
    assert torch.isfinite(y).all() and not torch.allclose(y, outs[0])


def test_absorbed_decode_equals_training_attention_and_generation():
    cfg = small(mtp_depth=0)
    model = build(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = model(tokens)
        cache = model.allocate_cache(2, 20, torch.device("cpu"), torch.float32)
        steps = [model(tokens[:, :7], cache=cache)]
        steps += [model(tokens[:, i : i + 1], cache=cache, start_pos=i) for i in range(7, 20)]
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-5
    prompt = tokens[0, :5].tolist()
    cached = generate(model, prompt, 12, temperature=0.0, use_cache=True)
    plain = generate(model, prompt, 12, temperature=0.0, use_cache=False)
    assert cached == plain and len(cached) == 12


def test_hf_round_trip_is_exact():
    cfg = small()
    model = build(cfg)
    state = model.state_dict()
    exported = hf.to_hf_state_dict(state, cfg)
    assert "model.layers.3.eh_proj.weight" in exported  # MTP in the checkpoint's naming
    back = hf.from_hf_state_dict(exported, cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    # per-expert safetensors naming imports to the same tensors
    fused = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    split = {k: v for k, v in exported.items() if not k.endswith(fused)}
    for k, v in exported.items():
        if k.endswith(fused):
            prefix = k.rsplit(".", 1)[0]
            for e in range(v.shape[0]):
                if k.endswith("gate_up_proj"):
                    g, u = v[e].chunk(2)
                    (
                        split[f"{prefix}.{e}.gate_proj.weight"],
                        split[f"{prefix}.{e}.up_proj.weight"],
                    ) = g, u
                else:
                    split[f"{prefix}.{e}.down_proj.weight"] = v[e]
    back = hf.from_hf_state_dict(split, cfg)
    assert all(torch.equal(back[k], state[k]) for k in state)
    cfg_back = dataclasses.replace(cfg, **hf.config_from_hf(hf.hf_config(cfg)))
    assert cfg_back == cfg
