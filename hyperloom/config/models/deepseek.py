"""Model fields of the DeepSeek family (hyperloom.models.deepseek) and their checks.

Mixture-of-Experts (routed and shared experts, group-limited routing, balancing), Multi-head
Latent Attention (low-rank query and key/value, decoupled RoPE, its softmax scale under RoPE
scaling) and Multi-Token Prediction. The keys stay in the one flat `[model]` section
(`--model.n_routed_experts 8`); other families must leave them at their defaults, and the
checks here say so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig
    from hyperloom.config.model import ModelConfig


@dataclass(frozen=True)
class DeepSeekFields:
    """Mixture-of-Experts, MLA and MTP (family 'deepseek')."""

    n_routed_experts: int = knob(0, "MoE routed experts per MoE layer (0 = dense model)")
    n_shared_experts: int = knob(0, "MoE shared experts (one SwiGLU of n x moe_ffn_dim)")
    moe_top_k: int = knob(0, "routed experts per token")
    moe_ffn_dim: int = knob(0, "SwiGLU hidden width of one expert")
    n_dense_layers: int = knob(0, "the first k layers use the dense ffn_dim SwiGLU, not MoE")
    moe_score: str = knob(
        "softmax", "router scores: softmax (V2) or sigmoid (V3)", choices=["softmax", "sigmoid"]
    )
    moe_n_groups: int = knob(1, "expert groups for group-limited routing (1 = off)")
    moe_topk_groups: int = knob(1, "groups a token may route to")
    moe_norm_topk: bool = knob(True, "renormalise the top-k gate weights to sum to one")
    moe_route_scale: float = knob(1.0, "routed scaling factor on the gate weights")
    moe_capacity_factor: float = knob(
        0.0, "expert capacity factor, tokens over it dropped (0 = dropless)"
    )
    moe_bias_rate: float = knob(0.0, "aux-loss-free balancing bias step gamma (0 = off)")
    moe_seq_aux_alpha: float = knob(0.0, "sequence-wise balance loss weight alpha (0 = off)")
    moe_aux_alpha: float = knob(0.0, "batch-wise (Switch/GShard) balance loss weight (0 = off)")
    moe_z_loss: float = knob(0.0, "router z-loss weight (0 = off)")
    moe_imbalance: float = knob(
        1.25,
        "planner only: tokens the busiest expert-parallel rank receives over the mean "
        "(hyperloom plan's load assumption; 1 = perfectly balanced routing)",
    )
    q_lora_rank: int = knob(0, "MLA low-rank query width (0 = plain query projection)")
    kv_lora_rank: int = knob(0, "MLA compressed key/value width (the cached latent)")
    qk_nope_head_dim: int = knob(0, "MLA per-head query/key width without RoPE")
    qk_rope_head_dim: int = knob(0, "MLA decoupled RoPE width (one key shared by all heads)")
    v_head_dim: int = knob(0, "MLA per-head value width")
    yarn_mscale: float = knob(
        1.0, "MLA softmax-scale coefficient under RoPE scaling (HF mscale_all_dim; 0 = off)"
    )
    mtp_depth: int = knob(0, "multi-token prediction modules D (0 = off)")
    mtp_loss_weight: float = knob(0.3, "MTP loss weight lambda; each module's loss gets lambda / D")


def deepseek_problems(job: JobConfig) -> list[str]:
    """The MoE / MLA / MTP keys, and the parallel layouts built for them, arithmetic shown.
    For another family: these keys unset and no expert parallelism."""
    m, par = job.model, job.parallel
    out: list[str] = []
    if m.decoder_family != "deepseek":
        used = [
            f.name for f in dataclasses.fields(DeepSeekFields) if getattr(m, f.name) != f.default
        ]
        if used:
            also = ", ".join(f"model.{k}" for k in used[1:])
            out.append(
                f"model.{used[0]} needs model.family = 'deepseek' or a vlm with "
                f"model.vlm_decoder = 'deepseek' (got '{m.family}')"
                + (f"; so do {also}" if also else "")
            )
        if par.ep > 1:
            out.append(
                f"parallel.ep = {par.ep} needs a Mixture-of-Experts model "
                f"(model.family = 'deepseek' with model.n_routed_experts > 0)"
            )
        return out
    if par.ep > 1:
        out.extend(_expert_parallel_problems(job))
    if par.tp > 1:
        out.extend(_tensor_parallel_problems(job))
    if m.qk_norm:
        out.append(
            "model.qk_norm is built for model.family = 'llama'; MLA (family 'deepseek') "
            "already normalises its query and key latents (q_norm, kv_norm)"
        )
    return out + _mla_problems(m) + _moe_problems(m)


def _mla_problems(m: ModelConfig) -> list[str]:
    out = []
    for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        if getattr(m, key) <= 0:
            out.append(f"model.{key} must be positive for MLA, got {getattr(m, key)}")
    if m.qk_rope_head_dim <= 0 or m.qk_rope_head_dim % 2:
        out.append(
            f"model.qk_rope_head_dim must be positive and even (RoPE rotates pairs), "
            f"got {m.qk_rope_head_dim}"
        )
    if m.q_lora_rank < 0:
        out.append(
            f"model.q_lora_rank must be >= 0 (0 = plain query projection), got {m.q_lora_rank}"
        )
    if m.mtp_depth < 0 or m.mtp_loss_weight < 0:
        out.append(
            f"model.mtp_depth ({m.mtp_depth}) and model.mtp_loss_weight ({m.mtp_loss_weight}) "
            f"must be >= 0"
        )
    if m.yarn_mscale < 0:
        out.append(f"model.yarn_mscale must be >= 0, got {m.yarn_mscale}")
    return out


def _moe_problems(m: ModelConfig) -> list[str]:
    out = []
    if not 0 <= m.n_dense_layers <= m.n_layers:
        out.append(
            f"model.n_dense_layers ({m.n_dense_layers}) must lie in "
            f"[0, model.n_layers ({m.n_layers})]"
        )
    if m.moe_route_scale <= 0:
        out.append(f"model.moe_route_scale must be positive, got {m.moe_route_scale}")
    if not m.moe_imbalance >= 1:
        out.append(
            f"model.moe_imbalance must be >= 1 (the busiest rank's load over the mean), "
            f"got {m.moe_imbalance}"
        )
    for key in (
        "moe_bias_rate",
        "moe_seq_aux_alpha",
        "moe_aux_alpha",
        "moe_z_loss",
        "moe_capacity_factor",
    ):
        if getattr(m, key) < 0:
            out.append(f"model.{key} must be >= 0, got {getattr(m, key)}")
    E, k = m.n_routed_experts, m.moe_top_k
    if E < 0 or m.n_shared_experts < 0:
        out.append(
            f"model.n_routed_experts ({E}) and model.n_shared_experts ({m.n_shared_experts}) "
            f"must be >= 0"
        )
    if E <= 0:
        if m.n_dense_layers < m.n_layers and E == 0 and m.n_layers > 0:
            out.append(
                f"model.n_routed_experts = 0 but layers {m.n_dense_layers}..{m.n_layers - 1} "
                f"are MoE (model.n_dense_layers = {m.n_dense_layers}); set experts or "
                f"n_dense_layers = n_layers"
            )
        return out
    if not 1 <= k <= E:
        out.append(f"model.moe_top_k ({k}) must lie in [1, model.n_routed_experts ({E})]")
    if m.moe_ffn_dim <= 0:
        out.append(f"model.moe_ffn_dim must be positive, got {m.moe_ffn_dim}")
    G, kg = m.moe_n_groups, m.moe_topk_groups
    if G < 1 or E % G:
        out.append(
            f"model.n_routed_experts ({E}) is not divisible by model.moe_n_groups ({G}): "
            f"{E} / {G} = {E / G if G else float('nan'):.4g} experts per group"
        )
    elif not 1 <= kg <= G:
        out.append(f"model.moe_topk_groups ({kg}) must lie in [1, model.moe_n_groups ({G})]")
    elif kg * (E // G) < k:
        out.append(
            f"group-limited routing keeps moe_topk_groups({kg}) x {E} / {G} experts per group = "
            f"{kg * (E // G)} experts < model.moe_top_k ({k})"
        )
    elif G > 1 and m.moe_score == "sigmoid" and E // G < 2:
        out.append(
            f"sigmoid routing scores a group by its top-2 experts, but {E} / {G} = {E // G} "
            f"expert per group; use fewer groups"
        )
    return out


def _expert_parallel_problems(job: JobConfig) -> list[str]:
    """ep > 1 for an MoE model: the experts split evenly (DDP, ZeRO-1 and FSDP2 reduce and
    shard them over their own replicas)."""
    m, par = job.model, job.parallel
    out = []
    if m.n_routed_experts % par.ep:
        out.append(
            f"model.n_routed_experts ({m.n_routed_experts}) must be divisible by parallel.ep "
            f"({par.ep}): each expert-parallel rank holds n_routed_experts / ep experts"
        )
    return out


def _tensor_parallel_problems(job: JobConfig) -> list[str]:
    """tp > 1 (hyperloom.models.deepseek.plan): heads and the shared experts' width split
    (sp's sequence divisibility is checked with Llama's, in config.parallel)."""
    m, tp = job.model, job.parallel.tp
    out = []
    shared = m.n_shared_experts * m.moe_ffn_dim
    if m.n_routed_experts and shared % tp:
        out.append(
            f"model.n_shared_experts * model.moe_ffn_dim ({shared}) is not divisible by "
            f"parallel.tp ({tp}): the shared experts' SwiGLU width splits over tp"
        )
    return out


def deepseek_tp_widths(m: ModelConfig) -> dict[str, int]:
    """The widths tensor parallelism splits in a DeepSeek block (MLA's heads and the SwiGLU
    widths), named for messages; 0 where the model has no such layer."""
    q_rows = m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    kv_rows = m.n_heads * (m.qk_nope_head_dim + m.v_head_dim)
    wq = "wq_b" if m.q_lora_rank else "wq"
    dense = m.ffn_dim if m.n_dense_layers or not m.n_routed_experts else 0
    shared = m.n_shared_experts * m.moe_ffn_dim if m.n_routed_experts else 0
    return {
        f"model.n_heads * (qk_nope_head_dim + qk_rope_head_dim) ({wq} rows)": q_rows,
        "model.n_heads * (qk_nope_head_dim + v_head_dim) (wkv_b rows)": kv_rows,
        "model.n_heads * v_head_dim (wo columns)": m.n_heads * m.v_head_dim,
        "model.ffn_dim (the dense layers' w1, w3 rows, w2 columns)": dense,
        "model.n_shared_experts * model.moe_ffn_dim (the shared experts' width)": shared,
    }
