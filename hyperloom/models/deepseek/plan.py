"""Parallel plans for the DeepSeek family.

**Tensor parallelism** (`tp_plan`; no sequence parallelism). MLA splits by heads as Megatron
does: the up-projections wq_b (or wq) and wkv_b are column-parallel, wo row-parallel. The
low-rank down-projections wq_a, wkv_a run replicated on the block's input; their outputs
feed only this rank's heads (the decoupled RoPE key k_pe, a slice of wkv_a's output, every
local head), so the gradient reaching those outputs is a partial sum per rank. It is summed
over tp right there, before the down-projections' backward ("tp_output_grad"), rather than at
the block's input after it:

- each rank's down-projection backward sees the whole output gradient, so its weight
  gradient is whole (no sum after backward) and its input gradient needs no sum either;
- under FP8 that gradient is quantized whole, as one process quantizes it -- quantizing
  per-rank partial sums and adding the products afterwards is not the same arithmetic;
- the all-reduce carries q_lora_rank + kv_lora_rank + rope columns per token instead of dim
  (2,112 against 7,168 for DeepSeek-V3).

The latent norms q_norm, kv_norm sit between that sum and the up-projections: their output
gradient is still partial, so their weight gradients are summed after backward
("tp_partial_grad"). Without q_lora, wq is column-parallel on the block input itself and
sums its own input gradient ("colwise_tp_input"). The dense first layers and the shared
experts are split like Llama's SwiGLU. The routed experts and the router run replicated on
every tp rank (the layer's tokens are whole on each): the gradients agree across tp without
communication, at the cost of repeating the routed-expert compute tp times — expert
parallelism (over dp) is what divides it.

**Pipeline parallelism** cuts the model like Llama's (`hyperloom.models.llama.plan`), with one
difference: the multi-token-prediction modules live on the last stage (DeepSeek-V3, arXiv
2412.19437 §3.2.2 — "the MTP module and the main model's output head on the same PP rank"),
and they read the token embedding, so the last stage keeps a copy of it whose gradient the
runtime sums with the first stage's. Expert parallelism is applied from outside by
`hyperloom.parallel.expert_parallel`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperloom.config import ModelConfig
from hyperloom.models.llama.plan import pipeline_chunk as _llama_chunk

if TYPE_CHECKING:  # the registry imports this module; `model info` needs no torch
    from torch import nn

_MLA = {
    "attention.wq_a": "tp_output_grad",
    "attention.q_norm": "tp_partial_grad",
    "attention.wkv_a": "tp_output_grad",
    "attention.kv_norm": "tp_partial_grad",
    "attention.wkv_b": "colwise",  # heads split across ranks
    "attention.wo": "rowwise",
}
_SWIGLU = {"": "tp_input", ".w1": "colwise", ".w3": "colwise", ".w2": "rowwise"}


def tp_plan(cfg: ModelConfig) -> dict[str, str]:
    """Module path pattern -> tensor-parallel style for this model's shape (see above)."""
    plan = {"tok_embeddings": "vocab_embedding", "output": "vocab_head"}
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
