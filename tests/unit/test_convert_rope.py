"""RoPE scaling as the converters need it (linear, llama3, yarn; `model.rope_type`) against
transformers' own tables, the keys' resolution and checks, and the `hf:DIR` model preset."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hyperloom.checkpoint.hf import ConvertError  # noqa: F401 - registers the hf: preset
from hyperloom.config import ConfigError, ModelConfig, config_from_dict, preset_config
from hyperloom.engine import ops
from hyperloom.models.llama.model import rope_tables_of

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

LLAMA = dict(dim=64, n_heads=4, n_kv_heads=2, max_seq_len=64, rope_original_max_seq=16)


@pytest.mark.parametrize(
    "values,rope",
    [
        ({"rope_type": "linear", "rope_scaling": 4.0}, {"rope_type": "linear", "factor": 4.0}),
        (
            {"rope_type": "yarn", "rope_scaling": 8.0, "yarn_beta_fast": 8.0},
            {"rope_type": "yarn", "factor": 8.0, "beta_fast": 8.0, "beta_slow": 1.0,
             "original_max_position_embeddings": 16},
        ),
        (
            {"rope_type": "yarn", "rope_scaling": 4.0, "yarn_attn_factor": 1.25},
            {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.25,
             "original_max_position_embeddings": 16},
        ),
    ],
    ids=["linear", "yarn", "yarn-attention-factor"],
)  # fmt: skip
def test_scaled_tables_equal_transformers(values, rope):
    """Inverse frequencies and the cos/sin multiplier, as transformers computes them."""
    cfg = dataclasses.replace(preset_config("tiny"), **LLAMA, **values)
    hf = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
        rope_parameters={"rope_theta": cfg.rope_theta, **rope},
    )  # fmt: skip
    inv, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    ours = ops.scaled_inv_freq(
        cfg.rope_kind, 16, cfg.rope_theta, cfg.rope_scaling, original_max_seq=16,
        beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow,
    )  # fmt: skip
    torch.testing.assert_close(ours.float(), inv, rtol=1e-6, atol=0)
    assert cfg.rope_attention_factor == pytest.approx(factor, rel=1e-12)
    cos, _ = rope_tables_of(cfg, 16, torch.device("cpu"))
    assert cos[0, 0].item() == pytest.approx(factor, rel=1e-6)  # angle 0: the factor itself


def test_rope_kind_and_attention_factor_by_family():
    llama = dataclasses.replace(preset_config("tiny"), rope_scaling=4.0)
    deepseek = dataclasses.replace(preset_config("moe-tiny"), rope_scaling=4.0)
    assert (llama.rope_kind, deepseek.rope_kind) == ("llama3", "yarn")  # rope_type auto
    assert (llama.rope_attention_factor, deepseek.rope_attention_factor) == (1.0, 1.0)
    yarn = dataclasses.replace(llama, rope_type="yarn")
    assert yarn.rope_attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)  # YaRN's
    assert dataclasses.replace(yarn, yarn_attn_factor=1.3).rope_attention_factor == 1.3
    assert dataclasses.replace(yarn, rope_scaling=1.0).rope_kind == "default"


@pytest.mark.parametrize(
    "values,problem",
    [
        (
            {"rope_scaling": 4.0, "yarn_attn_factor": 1.2},
            "model.yarn_attn_factor = 1.2 is read only by YaRN, but the RoPE scaling in "
            "effect is 'llama3' (rope_scaling = 4.0, rope_type = 'auto')",
        ),
        ({"rope_type": "yarn", "yarn_attn_factor": -1.0}, "model.yarn_attn_factor must be >= 0"),
        ({"yarn_beta_slow": 0.0}, "model.yarn_beta_slow must be positive (rotations), got 0.0"),
        ({"rope_type": "cubic"}, "model.rope_type"),
    ],
)
def test_rope_keys_are_checked(values, problem):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": values})
    assert problem in str(info.value)


def test_hf_preset_takes_the_architecture_from_config_json(tmp_path):
    config = transformers.Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 32},
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(config).save_pretrained(str(tmp_path / "hf"))
    preset = f"hf:{tmp_path / 'hf'}"
    job = config_from_dict(
        {"model": {"preset": preset, "max_seq_len": 64}, "data": {"seq_len": 64}}
    )
    m = job.model
    assert (m.family, m.qk_norm, m.dim, m.n_kv_heads, m.max_seq_len) == ("llama", True, 32, 1, 64)
    assert (m.rope_kind, m.rope_scaling, m.rope_theta, m.rope_original_max_seq) == (
        "yarn", 4.0, 1e6, 32
    )  # fmt: skip
    assert m.rope_attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    assert isinstance(m, ModelConfig)
    with pytest.raises(ConfigError, match=r"model.preset: 'hf:.*nowhere': .* \(no config.json\)"):
        config_from_dict({"model": {"preset": f"hf:{tmp_path / 'nowhere'}"}})
    with pytest.raises(ConfigError, match="or hf:PATH"):
        config_from_dict({"model": {"preset": "llama-9000"}})
