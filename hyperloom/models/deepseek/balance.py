"""Expert load balancing: the auxiliary-loss-free bias, balance losses and the router z-loss.

**Auxiliary-loss-free balancing** (arXiv 2408.15664; DeepSeek-V3, arXiv 2412.19437 §2.1.2).
Each expert has a bias b_i added to its affinity for selection only (`moe.Router`). After
every optimizer step the step's token counts c_i are summed over data parallelism (every
rank must move its bias identically) and

    b_i ← b_i + γ · sign(mean(c) − c_i)

No gradient flows through b, so balancing does not pull the router away from the language
loss, which an auxiliary loss strong enough to balance measurably does (the paper's Table 5).
Megatron-LM's `get_updated_expert_bias` is the same update.

**Sequence-wise balance loss** (V3 eq. 17-20), a weak complement (α = 1e-4) against any one
sequence being extremely unbalanced:

    L = α Σ_i f_i P_i,   f_i = E / (k T) · Σ_t 1[i ∈ TopK_t],   P_i = 1/T Σ_t s'_{i,t}

with s' the per-token normalised affinities and T one sequence's tokens, averaged over the
batch. The batch-wise loss (Switch, arXiv 2101.03961; GShard) is the same over the batch.

**Router z-loss** (ST-MoE, arXiv 2202.08906 eq. 5): the mean of logsumexp(logits)², which
keeps router logits small so the float32 softmax/sigmoid stays well conditioned.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn


def balance_loss(
    scores: torch.Tensor, experts: torch.Tensor, group=None, sequence=None
) -> torch.Tensor:
    """Σ_i f_i P_i averaged over rows: scores (n, T, E) affinities, experts (n, T, k) ids.

    `group` (context parallelism): the T tokens of each row are spread over its ranks, so
    the counts and affinity sums are summed over it first (the affinities' sum with its
    gradient), which makes f and P those of the whole rows on every rank. `sequence`
    (sequence parallelism, a `SequenceShard`): likewise over the tp ranks, whose loss is one
    loss computed alike on each, so that sum's backward is the identity."""
    n, t, n_experts = scores.shape
    k = experts.shape[-1]
    hits = torch.zeros_like(scores).scatter_(-1, experts, 1.0)  # (n, T, E) one-hot of top-k
    counts = hits.sum(1)  # (n, E); no gradient
    p = (scores / scores.sum(-1, keepdim=True)).sum(1)  # (n, E)
    if group is not None:
        dist.all_reduce(counts, group=group)
        p = dist_nn.all_reduce(p, group=group)  # backward: the ranks' gradients summed
        t *= dist.get_world_size(group)
    if sequence is not None:
        counts, p = sequence.sum(counts), sequence.sum(p)
        t *= sequence.size
    f = counts * (n_experts / (k * t))
    return (f * p / t).sum(-1).mean()


def aux_losses(
    scores: torch.Tensor,
    experts: torch.Tensor,
    logits: torch.Tensor,
    seq_alpha: float = 0.0,
    batch_alpha: float = 0.0,
    z_weight: float = 0.0,
    group=None,
    sequence=None,
) -> torch.Tensor | None:
    """The weighted sum of the enabled losses (None if none is): scores (b, s, E), experts
    (b, s, k), logits (b * s, E); `group`: the context-parallel ranks sharing each sequence;
    `sequence`: the sequence-parallel `SequenceShard`, whose ranks' loss is the whole one."""
    total = None
    if seq_alpha > 0:
        total = seq_alpha * balance_loss(scores, experts, group, sequence)
    if batch_alpha > 0:
        flat = scores.flatten(0, 1)[None], experts.flatten(0, 1)[None]
        term = batch_alpha * balance_loss(*flat, group, sequence)
        total = term if total is None else total + term
    if z_weight > 0:
        z = torch.logsumexp(logits, dim=-1).square().mean()
        if sequence is not None:  # the mean over the tp ranks' equal slices
            z = sequence.sum(z) / sequence.size
        term = z_weight * z
        total = term if total is None else total + term
    return total


@torch.no_grad()
def update_bias(
    biases: list[torch.Tensor], counts: list[torch.Tensor], rate: float, group=None
) -> torch.Tensor:
    """Reduce the step's per-expert token counts over `group` (all layers in one all-reduce),
    move each layer's bias by ±rate towards balance, and return the reduced counts
    (layers, E)."""
    loads = torch.stack([c.float() for c in counts])  # (layers, E)
    if group is not None:
        dist.all_reduce(loads, group=group)
    if rate > 0:
        step = torch.sign(loads.mean(-1, keepdim=True) - loads) * rate  # (layers, E)
        for bias, delta in zip(biases, step, strict=True):
            bias.add_(delta.to(bias.dtype))
    return loads


def load_imbalance(loads: torch.Tensor) -> torch.Tensor:
    """max / mean tokens per expert, per layer, from loads (layers, E); 1.0 is perfect."""
    return loads.amax(-1) / loads.mean(-1).clamp(min=1e-9)
