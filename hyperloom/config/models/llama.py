"""Model fields of the Llama-style decoder, which every family builds on, and their checks.

Sizes, attention heads, RoPE (with linear, Llama 3.1 or YaRN frequency scaling, `rope_type`),
norm, init and dropout are read by every family; `qk_norm` (OLMo 2 / Qwen3) is built for the llama family only, and the
DeepSeek group rejects it. The fields keep the order of the `[model]` section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob, positive

if TYPE_CHECKING:
    from hyperloom.config.model import ModelConfig


@dataclass(frozen=True)
class LlamaFields:
    """The decoder's shape: the `[model]` keys every family reads."""

    vocab_size: int = knob(16384, "vocabulary size (the built-in tokenizer is trained to it)")
    dim: int = knob(384, "model width (hidden size)")
    n_layers: int = knob(6, "number of transformer blocks")
    n_heads: int = knob(6, "attention (query) heads")
    n_kv_heads: int = knob(2, "key/value heads for grouped-query attention")
    ffn_dim: int = knob(1024, "SwiGLU hidden width")
    norm_eps: float = knob(1e-5, "RMSNorm epsilon")
    rope_theta: float = knob(10000.0, "RoPE base frequency")
    rope_scaling: float = knob(1.0, "RoPE context-extension factor s (1 = none); see rope_type")
    rope_type: str = knob(
        "auto",
        "how rope_scaling > 1 stretches the RoPE frequencies: linear (position interpolation), "
        "llama3 (Llama 3.1), yarn; auto = llama3 for llama, yarn for deepseek",
        choices=["auto", "linear", "llama3", "yarn"],
    )
    rope_low_freq_factor: float = knob(1.0, "Llama-3.1 RoPE low-frequency factor")
    rope_high_freq_factor: float = knob(4.0, "Llama-3.1 RoPE high-frequency factor")
    rope_original_max_seq: int = knob(8192, "context length the RoPE scaling extends from")
    yarn_beta_fast: float = knob(32.0, "YaRN ramp end (rotations within the original context)")
    yarn_beta_slow: float = knob(1.0, "YaRN ramp start (rotations)")
    yarn_attn_factor: float = knob(
        0.0,
        "YaRN's multiplier on the RoPE cos/sin tables (HF attention_factor); 0 = the family's "
        "default: 0.1 ln(rope_scaling) + 1 for llama, 1 for deepseek (yarn_mscale instead)",
    )
    max_seq_len: int = knob(2048, "longest sequence the RoPE tables are built for")
    tie_embeddings: bool = knob(False, "share the input embedding with the output head")
    qk_norm: bool = knob(
        False, "RMSNorm on each head's query and key before RoPE (OLMo 2 / Qwen3); llama only"
    )
    init_std: float = knob(0.02, "std of the normal weight init (output projections scaled)")
    dropout: float = knob(
        0.0, "training dropout on attention weights and each block's residual branches (0 = off)"
    )


def decoder_problems(m: ModelConfig) -> list[str]:
    """Sizes positive; heads that split the width into even head dims; RoPE scaling sane."""
    heads = [
        *positive("model.dim", m.dim),
        *positive("model.n_heads", m.n_heads),
        *positive("model.n_kv_heads", m.n_kv_heads),
    ]
    p = [
        *heads,
        *positive("model.n_layers", m.n_layers),
        *positive("model.ffn_dim", m.ffn_dim),
        *positive("model.max_seq_len", m.max_seq_len),
        *positive("model.norm_eps", m.norm_eps),
        *positive("model.rope_theta", m.rope_theta),
        *positive("model.init_std", m.init_std),
        *positive("model.rope_low_freq_factor", m.rope_low_freq_factor),
        *positive("model.rope_high_freq_factor", m.rope_high_freq_factor),
        *positive("model.rope_original_max_seq", m.rope_original_max_seq),
    ]
    if m.vocab_size < 2:
        p.append(f"model.vocab_size must be at least 2, got {m.vocab_size}")
    if not 0.0 <= m.dropout < 1.0:
        p.append(f"model.dropout must lie in [0, 1), got {m.dropout}")
    if not heads:
        if m.dim % m.n_heads:
            p.append(
                f"model.dim ({m.dim}) is not divisible by model.n_heads ({m.n_heads}): "
                f"{m.dim} / {m.n_heads} = {m.dim / m.n_heads:.4g}"
            )
        elif (m.dim // m.n_heads) % 2:
            p.append(
                f"head dim model.dim / model.n_heads = {m.dim} / {m.n_heads} = "
                f"{m.dim // m.n_heads} is odd; RoPE rotates pairs, so it must be even"
            )
        if m.n_heads % m.n_kv_heads:
            p.append(
                f"model.n_heads ({m.n_heads}) is not divisible by model.n_kv_heads "
                f"({m.n_kv_heads}): {m.n_heads} / {m.n_kv_heads} = {m.n_heads / m.n_kv_heads:.4g}"
            )
    return p + _rope_problems(m)


def _rope_problems(m: ModelConfig) -> list[str]:
    """RoPE scaling: a factor >= 1, and the parameters of the kind in effect sane."""
    p = []
    if m.rope_scaling < 1:
        p.append(f"model.rope_scaling must be >= 1 (1 = no scaling), got {m.rope_scaling}")
    elif m.rope_kind == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        p.append(
            f"model.rope_high_freq_factor ({m.rope_high_freq_factor}) must exceed "
            f"model.rope_low_freq_factor ({m.rope_low_freq_factor})"
        )
    # YaRN's ramp is measured in rotations (a logarithm of them): both ends positive.
    for key in ("yarn_beta_fast", "yarn_beta_slow"):
        if getattr(m, key) <= 0:
            p.append(f"model.{key} must be positive (rotations), got {getattr(m, key)}")
    if m.yarn_attn_factor < 0:
        p.append(f"model.yarn_attn_factor must be >= 0 (0 = default), got {m.yarn_attn_factor}")
    elif m.yarn_attn_factor and m.rope_kind != "yarn":
        p.append(
            f"model.yarn_attn_factor = {m.yarn_attn_factor} is read only by YaRN, but the RoPE "
            f"scaling in effect is '{m.rope_kind}' (rope_scaling = {m.rope_scaling}, rope_type "
            f"= '{m.rope_type}')"
        )
    return p


def llama_tp_widths(m: ModelConfig) -> dict[str, int]:
    """The widths tensor parallelism splits in a llama block, named for messages."""
    if m.dim % m.n_heads:
        return {}  # reported by decoder_problems
    head_dim = m.dim // m.n_heads
    return {
        "model.dim (wq rows, wo columns)": m.dim,
        "model.n_kv_heads * head_dim (wk, wv rows)": m.n_kv_heads * head_dim,
        "model.ffn_dim (w1, w3 rows, w2 columns)": m.ffn_dim,
    }
