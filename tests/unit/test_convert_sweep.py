"""Hugging Face conversion, key by key: every config key the importers accept, swept.

Each case builds a tiny transformers model from a config (LlamaForCausalLM, Qwen3ForCausalLM,
DeepseekV3ForCausalLM, DeepseekV2ForCausalLM), gives it random weights of a size that makes
logits O(1) (so 1e-5 separates right from wrong), saves it with `save_pretrained`, imports it
with `hyperloom convert import`'s code and compares our logits with transformers' in fp32;
then exports the import and compares transformers' logits of the export, and imports the
export again bit for bit. Every key the model cannot represent is refused, by its name, with
nothing written.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hyperloom import checkpoint as ckpt
from hyperloom.checkpoint.hf import ConvertError, export_hf, import_hf
from hyperloom.config import config_from_dict, read_toml
from hyperloom.models.registry import build_model

transformers = pytest.importorskip("transformers")

TOL = 1e-5
LLAMA = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    rms_norm_eps=1e-5,
)  # fmt: skip
DEEPSEEK = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2,
    first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    max_position_embeddings=64, rms_norm_eps=1e-6, num_nextn_predict_layers=0,
)  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

# name -> (transformers config class, its keys beyond the family's base)
CASES = {
    "llama-gqa": ("LlamaConfig", {}),
    "llama-mha": ("LlamaConfig", {"num_key_value_heads": 4}),
    "llama-mqa": ("LlamaConfig", {"num_key_value_heads": 1}),
    "llama-head-dim": ("LlamaConfig", {"head_dim": 8}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama-theta-eps": ("LlamaConfig", {"rope_theta": 500000.0, "rms_norm_eps": 1e-6}),
    "llama-rope-linear": ("LlamaConfig", {"rope": {"rope_type": "linear", "factor": 4.0}}),
    "llama-rope-llama3": (
        "LlamaConfig",
        {
            "rope": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),  # fmt: skip
    "llama-rope-yarn": ("LlamaConfig", {"rope": YARN}),
    "llama-rope-yarn-betas-factor": (
        "LlamaConfig",
        {"rope": {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3}},
    ),
    "llama-rope-yarn-mscales": (
        "LlamaConfig",
        {"rope": {**YARN, "mscale": 0.9, "mscale_all_dim": 0.5}},
    ),  # fmt: skip
    "qwen3-qk-norm": ("Qwen3Config", {"head_dim": 8}),
    "qwen3-yarn-tied-mqa": (
        "Qwen3Config",
        {"head_dim": 8, "rope": YARN, "tie_word_embeddings": True, "num_key_value_heads": 1},
    ),
    "v3": ("DeepseekV3Config", {}),
    "v3-no-q-lora": ("DeepseekV3Config", {"q_lora_rank": None}),
    "v3-no-norm-topk": ("DeepseekV3Config", {"norm_topk_prob": False}),
    "v3-one-group-top1": (
        "DeepseekV3Config",
        {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 1},
    ),  # fmt: skip
    "v3-no-shared": ("DeepseekV3Config", {"n_shared_experts": 0}),
    "v3-two-shared-no-dense": (
        "DeepseekV3Config",
        {"n_shared_experts": 2, "first_k_dense_replace": 0},
    ),  # fmt: skip
    "v3-all-dense": ("DeepseekV3Config", {"first_k_dense_replace": 3}),
    "v3-route-scale-1-eps": (
        "DeepseekV3Config",
        {"routed_scaling_factor": 1.0, "rms_norm_eps": 1e-5},
    ),  # fmt: skip
    "v3-tied": ("DeepseekV3Config", {"tie_word_embeddings": True}),
    "v3-half-split-rope": ("DeepseekV3Config", {"rope_interleave": False}),
    "v3-yarn-mscale": (
        "DeepseekV3Config",
        {"rope": {**YARN, "mscale": 0.7, "mscale_all_dim": 0.7}},
    ),
    "v3-yarn-mscales-differ": (
        "DeepseekV3Config",
        {"rope": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}},
    ),  # fmt: skip
    "v3-yarn-no-mscale": ("DeepseekV3Config", {"rope": YARN}),
    "v3-rope-linear-mscale": (
        "DeepseekV3Config",
        {"rope": {"rope_type": "linear", "factor": 2.0, "mscale_all_dim": 1.0}},
    ),  # fmt: skip
    "v3-mtp-declared-not-held": ("DeepseekV3Config", {"num_nextn_predict_layers": 1}),
    "v2-greedy": (
        "DeepseekV2Config",
        {
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "q_lora_rank": None,
            "routed_scaling_factor": 1.0,
        },
    ),  # fmt: skip
    "v2-group-limited-yarn": (
        "DeepseekV2Config",
        {
            "topk_method": "group_limited_greedy",
            "norm_topk_prob": False,
            "rope": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        },
    ),  # fmt: skip
}


def hf_config(config_class: str, keys: dict):
    keys = dict(keys)
    rope = {"rope_theta": keys.pop("rope_theta", 10000.0), **keys.pop("rope", {})}
    rope.setdefault("rope_type", "default")
    base = LLAMA if config_class in ("LlamaConfig", "Qwen3Config") else DEEPSEEK
    return getattr(transformers, config_class)(**{**base, **keys}, rope_parameters=rope)


def randomize(model, seed: int = 0):
    """Weights of unit-scale activations: norms around one, matrices and embeddings
    ~ N(0, 1 / width), a routing bias that changes choices."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if not p.is_floating_point() or "rotary" in name or not p.numel():
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * noise)
            else:  # an embedding too: as a tied head it must give O(1) logits
                p.copy_(noise * p.shape[-1] ** -0.5)
    return model.eval()


def save_hf(tmp_path, config_class: str, keys: dict):
    config = hf_config(config_class, keys)
    model = randomize(transformers.AutoModelForCausalLM.from_config(config))
    model.save_pretrained(str(tmp_path / "hf"))
    return model, tmp_path / "hf"


def ours_from(run_dir):
    """The model a hyperloom checkpoint holds, in fp32 eval mode."""
    path = ckpt.resolve_checkpoint(run_dir)
    raw = read_toml(path / "config.toml")
    model = build_model(config_from_dict(raw, world_size=1).model).materialize("cpu", seed=0)
    model.load_state_dict(ckpt.load_model_state(path))
    return model.eval()


def max_diff(ours, hf, vocab: int) -> float:
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens).logits
        assert theirs.std() > 0.3  # large enough that 1e-5 tells right from wrong
        return (ours(tokens) - theirs).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_import_and_export_match_transformers(case, tmp_path):
    config_class, keys = CASES[case]
    hf, hf_dir = save_hf(tmp_path, config_class, keys)
    ours = ours_from(import_hf(hf_dir, tmp_path / "run"))
    assert max_diff(ours, hf, hf.config.vocab_size) <= TOL
    out = export_hf(tmp_path / "run", tmp_path / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(exported).__name__ == type(hf).__name__
    assert max_diff(ours, exported, hf.config.vocab_size) <= TOL
    first = load_file(str(ckpt.resolve_checkpoint(tmp_path / "run") / "model.safetensors"))
    again = load_file(str(import_hf(out, tmp_path / "again") / "model.safetensors"))
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)


# (config class, keys, what the refusal names)
REFUSED = {
    "hidden-act": ("LlamaConfig", {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    "attention-bias": ("LlamaConfig", {"attention_bias": True}, "attention_bias = true"),
    "mlp-bias": ("LlamaConfig", {"mlp_bias": True}, "mlp_bias = true"),
    "attention-dropout": ("LlamaConfig", {"attention_dropout": 0.1}, "attention_dropout = 0.1"),
    "head-dim": ("LlamaConfig", {"head_dim": 16}, "head_dim 16 is not hidden_size"),
    "rope-dynamic": (
        "LlamaConfig",
        {"rope": {"rope_type": "dynamic", "factor": 2.0}},
        "rope_type = 'dynamic'",
    ),  # fmt: skip
    "rope-longrope": (
        "LlamaConfig",
        {
            "rope": {
                "rope_type": "longrope",
                "short_factor": [1.0] * 4,
                "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 16,
            }
        },
        "rope_type = 'longrope'",
    ),  # fmt: skip
    "rope-partial": (
        "LlamaConfig",
        {"rope": {**YARN, "partial_rotary_factor": 0.5}},
        "partial_rotary_factor",
    ),  # fmt: skip
    "yarn-truncate": ("LlamaConfig", {"rope": {**YARN, "truncate": False}}, "truncate = false"),
    "qwen3-sliding": (
        "Qwen3Config",
        {"head_dim": 8, "use_sliding_window": True},
        "use_sliding_window",
    ),  # fmt: skip
    "qwen3-head-dim": ("Qwen3Config", {"head_dim": 16}, "head_dim 16"),
    "v3-hidden-act": ("DeepseekV3Config", {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    "v3-attention-bias": ("DeepseekV3Config", {"attention_bias": True}, "attention_bias = true"),
    "v3-softmax": ("DeepseekV3Config", {"scoring_func": "softmax"}, "scoring_func = 'softmax'"),
    "v3-topk-method": ("DeepseekV3Config", {"topk_method": "greedy"}, "topk_method = 'greedy'"),
    "v3-moe-layer-freq": ("DeepseekV3Config", {"moe_layer_freq": 2}, "moe_layer_freq = 2"),
    "v3-quantized": (
        "DeepseekV3Config",
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
        "quantization_config (fp8)",
    ),
    "v2-norm-topk": ("DeepseekV2Config", {"norm_topk_prob": True}, "norm_topk_prob = true"),
    "v2-topk-method": ("DeepseekV2Config", {"topk_method": "noaux_tc"}, "topk_method = 'noaux_tc'"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_import_refuses_each_key_it_cannot_represent_by_name(case, tmp_path):
    config_class, keys, message = REFUSED[case]
    config = hf_config(config_class, keys)
    (tmp_path / "hf").mkdir()
    config.save_pretrained(str(tmp_path / "hf"))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ConvertError, match=message.replace("(", r"\(").replace(")", r"\)")):
        import_hf(tmp_path / "hf", tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_refusals_are_one_line_on_the_command_line(tmp_path, cli):
    """A refused key (here attention_bias, which once escaped as a KeyError traceback) is one
    line on stderr and exit status 2."""
    raw = hf_config("DeepseekV3Config", {}).to_dict()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**raw, "attention_bias": True}))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    result = cli("convert", "import", str(tmp_path / "hf"), str(tmp_path / "run"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "attention_bias = true: this model's linears have no bias" in result.stderr
