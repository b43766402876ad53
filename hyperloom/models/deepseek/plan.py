"""Parallel plans for the DeepSeek family.

Pipeline parallelism cuts the model like Llama's (`hyperloom.models.llama.plan`), with one
difference: the multi-token-prediction modules live on the last stage (DeepSeek-V3, arXiv
2412.19437 §3.2.2 — "the MTP module and the main model's output head on the same PP rank"),
and they read the token embedding, so the last stage keeps a copy of it whose gradient the
runtime sums with the first stage's. Expert parallelism is applied from outside by
`hyperloom.parallel.expert_parallel`. Tensor parallelism of MLA and the MoE layers is not
built; config validation rejects tp > 1 for this family, so the plan is empty.
"""

from __future__ import annotations

from torch import nn

from hyperloom.models.llama.plan import pipeline_chunk as _llama_chunk

TP_PLAN: dict[str, str] = {}


def pipeline_chunk(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """Cut `model` (on the meta device) down to one pipeline chunk, in place: layers
    `layers` under their global names, the embedding on the first chunk, and the final norm,
    head and MTP modules (with their embedding copy) on the last one."""
    embedding = model.tok_embeddings
    _llama_chunk(model, layers, first, last)
    if last and model.mtp:
        model.tok_embeddings = embedding
    if not last:
        model.mtp = nn.ModuleDict()
    return model
