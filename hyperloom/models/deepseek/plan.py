"""Parallel plans for the DeepSeek family.

**Tensor parallelism** (`tp_plan`). MLA splits by heads as Megatron does: wq_b (or wq) and
wkv_b column-parallel, wo row-parallel. The low-rank down-projections wq_a, wkv_a run
replicated and feed only this rank's heads, so their output gradient is a partial sum; it is
summed over tp right there ("tp_output_grad"), before their backward: their weight and input
gradients are then whole, FP8 quantizes the whole gradient as one process does, and the
all-reduce carries the latent width instead of dim. The latent norms between that sum and the
up-projections sum their weight gradients after backward ("tp_partial_grad"). Without q_lora,
wq sums its own input gradient ("colwise_tp_input"). Dense layers and shared experts split
like Llama's SwiGLU; routed experts and the router run replicated on every tp rank, and
expert parallelism (over dp) divides them.

**Sequence parallelism** (`parallel.sp`): the residual stream and norms hold 1/tp of each
sequence, as Llama's. MLA gathers its input ("sp_gather"): its consumers' input gradients are
whole already (the sums above), so the gather's backward keeps this rank's slice instead of a
reduce-scatter; wo reduce-scatters. The MoE layer routes only this rank's tokens: the router's
and routed experts' weight gradients are partial sums over tp ("sp_partial_grad"), its loads
and balance losses are reduced over tp (`MoE.sequence`), and the shared experts gather and
reduce-scatter like a dense SwiGLU. The MTP modules run on whole sequences, tensor-parallel
without sp (`whole_sequence_modules`; token i + k may sit on another rank).

**Pipeline parallelism** cuts like Llama's, except that the MTP modules live on the last
stage with the output head (arXiv 2412.19437 §3.2.2) and a copy of the embedding, whose
gradient the runtime sums with the first stage's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperloom.config import ModelConfig
from hyperloom.models.llama.plan import pipeline_chunk as _llama_chunk

if TYPE_CHECKING:  # the registry imports this module; `model info` needs no torch
    from torch import nn

_MLA = {
    "attention": "sp_gather",  # under sp: the input gathered for the down-projections
    "attention.wq_a": "tp_output_grad",
    "attention.q_norm": "tp_partial_grad",
    "attention.wkv_a": "tp_output_grad",
    "attention.kv_norm": "tp_partial_grad",
    "attention.wkv_b": "colwise",  # heads split across ranks
    "attention.wo": "rowwise",
}
_SWIGLU = {"": "tp_input", ".w1": "colwise", ".w3": "colwise", ".w2": "rowwise"}

# Where each recompute module sits in a block (`hyperloom.parallel.recompute`): Llama's, plus
# the shared experts' activation under "mlp_act", and "experts": the routed experts' bank
# checkpointed whole (Megatron's "moe" recompute), keeping only the dispatched rows (under
# expert parallelism the bank holds the dispatch, which the recompute runs again); "mla_up":
# MLA's up-projections, query RoPE and attention core from the latents (Megatron's
# mla_up_proj), which drops the per-head q, k and v.
RECOMPUTE_PLAN: dict[str, list] = {
    "core_attn": ["attention.core_attention"],
    "mlp_act": [
        ("feed_forward.act", "feed_forward.w2"),
        ("feed_forward.shared.act", "feed_forward.shared.w2"),
    ],
    "norm": [("attention_norm", "attention"), ("ffn_norm", "feed_forward")],
    "experts": ["feed_forward.experts"],
    "mla_up": ["attention.up_core"],  # wq_b / wkv_b, query RoPE and the core, from the latents
}


def recompute_plan(cfg: ModelConfig) -> dict[str, list]:
    """RECOMPUTE_PLAN: one for every shape of the family."""
    return RECOMPUTE_PLAN


def tp_plan(cfg: ModelConfig) -> dict[str, str]:
    """Module path pattern -> tensor-parallel style for this model's shape (see above)."""
    plan = {"tok_embeddings": "vocab_embedding", "output": "vocab_head", "norm": "sp_norm"}
    plan.update({f"layers.*.{n}": "sp_norm" for n in ("attention_norm", "ffn_norm")})
    q_up = (
        {"attention.wq_b": "colwise"} if cfg.q_lora_rank else {"attention.wq": "colwise_tp_input"}
    )
    mla = {k: v for k, v in _MLA.items() if cfg.q_lora_rank or "q_" not in k}
    for block in ("layers.*", "mtp.*") if cfg.mtp_depth else ("layers.*",):
        plan.update({f"{block}.{k}": v for k, v in {**mla, **q_up}.items()})
    # Dense SwiGLU blocks: the first n_dense_layers, or every block of a model without experts.
    if cfg.n_routed_experts:
        dense = [f"layers.{i}" for i in range(cfg.n_dense_layers)]
    else:
        dense = ["layers.*"] + (["mtp.*"] if cfg.mtp_depth else [])
    for block in dense:
        plan.update({f"{block}.feed_forward{k}": v for k, v in _SWIGLU.items()})
    if cfg.n_routed_experts and cfg.n_shared_experts:
        plan.update({f"*.feed_forward.shared{k}": v for k, v in _SWIGLU.items()})
    if cfg.n_routed_experts:  # under sp they see only this rank's tokens
        plan.update({f"*.feed_forward.{n}": "sp_partial_grad" for n in ("router", "experts")})
    return plan


def pipeline_chunk(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """Cut `model` (on the meta device) down to one pipeline chunk, in place: layers
    `layers` under their global names, the embedding on the first chunk, and the final norm,
    head and MTP modules (with their embedding copy) on the last one."""
    embedding = model.tok_embeddings
    _llama_chunk(model, layers, first, last)
    if last and model.mtp:
        model.tok_embeddings = embedding
    if not last:
        from torch import nn

        model.mtp = nn.ModuleDict()
    return model
