"""Mixture-of-Experts feed-forward layer of the DeepSeek family: gate, experts, shared experts.

**Gate** (DeepSeek-V3 §2.1.2; V2 §2.2). Affinities s = sigmoid(x Wᵀ) (V3) or softmax (V2) in
float32, since a bf16 near-tie flips routing. Selection uses s + b (b the balancing bias,
`balance`); the gate weights use the unbiased s, so the bias steers which experts a token
visits, never how much each contributes. Group-limited routing keeps the best
`moe_topk_groups` of `moe_n_groups` groups (scored by the sum of their top-2, V3's `noaux_tc`,
or their max, V2's) and takes the top-k inside them, so a token's experts live on few nodes.
Weights are renormalised (`moe_norm_topk`) and scaled by `moe_route_scale`.

**Experts** are the family-neutral grouped SwiGLU bank (`hyperloom.models.experts`). The layer
is dropless by default, as in V3; a capacity factor c caps each expert at
ceil(c · tokens · k / experts) assignments, keeping the earliest tokens (GShard, arXiv
2006.16668); a dropped assignment contributes nothing, the shared experts and residual still
carry the token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyperloom.config import ModelConfig
from hyperloom.engine import recompute
from hyperloom.models.deepseek import balance
from hyperloom.models.experts import Experts
from hyperloom.models.llama.model import FeedForward


@dataclass
class Routing:
    """One router decision for T tokens routed to k of E experts."""

    weights: torch.Tensor  # (T, k) float32 gate weights (unbiased scores, normalised, scaled)
    experts: torch.Tensor  # (T, k) int64 expert ids
    scores: torch.Tensor  # (T, E) float32 affinities s (before the bias)
    logits: torch.Tensor  # (T, E) float32 router logits


class Router(nn.Module):
    """The gate: float32 scores, biased selection, group limit, top-k, normalise and scale."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.moe_top_k
        self.score_func, self.norm_topk = cfg.moe_score, cfg.moe_norm_topk
        self.n_groups, self.topk_groups = cfg.moe_n_groups, cfg.moe_topk_groups
        self.route_scale = cfg.moe_route_scale
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        # A parameter (so checkpoints carry it) that no optimizer touches: it is moved by
        # `balance.update_bias` after each optimizer step, never by gradients.
        self.expert_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> Routing:
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())  # (T, E)
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(-1)
        choice = scores.detach() + self.expert_bias.float()  # selection only: no gradient
        if self.n_groups > 1:
            grouped = choice.unflatten(-1, (self.n_groups, -1))  # (T, groups, E / groups)
            if self.score_func == "sigmoid":
                group_score = grouped.topk(2, dim=-1).values.sum(-1)  # (T, groups)
            else:
                group_score = grouped.amax(-1)
            keep = group_score.topk(self.topk_groups, dim=-1).indices  # (T, topk_groups)
            mask = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
            choice = grouped.masked_fill(mask[..., None], float("-inf")).flatten(1)  # (T, E)
        experts = choice.topk(self.top_k, dim=-1).indices  # (T, k)
        weights = scores.gather(1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(weights * self.route_scale, experts, scores, logits)


class MoE(nn.Module):
    """y = Σ_k g_k E_k(x) + Shared(x) for x (batch, seq, dim), plus the balancing side-state:
    `counts` (tokens routed to each expert since the last optimizer step, for the bias update
    and the load statistics) and `aux_loss` (this forward's balance/z losses, or None)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.dim, cfg.moe_ffn_dim)
        self.shared = (
            FeedForward(cfg.dim, cfg.n_shared_experts * cfg.moe_ffn_dim)
            if cfg.n_shared_experts
            else None
        )
        self.counts: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        self.context = None  # context parallelism: balance losses over whole sequences
        # sequence parallelism: x holds this rank's 1/tp of each sequence; loads and balance
        # losses are reduced over tp
        self.sequence = None

    def capacity(self, n_tokens: int) -> int:
        """Assignments an expert may take (the whole batch's when dropless)."""
        c = self.cfg
        if c.moe_capacity_factor <= 0:
            return n_tokens * c.moe_top_k
        return math.ceil(c.moe_capacity_factor * n_tokens * c.moe_top_k / c.n_routed_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(b * s, d)  # (T, dim)
        r = self.router(flat)
        n_experts, k = self.cfg.n_routed_experts, self.cfg.moe_top_k
        assigned = r.experts.flatten()  # (T * k,) token t's j-th expert at t * k + j
        order = assigned.argsort(stable=True)  # assignments grouped by expert, token order kept
        counts = torch.bincount(assigned, minlength=n_experts)  # (E,)
        cap = self.capacity(b * s)
        if cap < b * s * k:  # drop each expert's assignments beyond its capacity
            starts = counts.cumsum(0) - counts  # (E,) first sorted slot of each expert
            rank = torch.arange(order.numel(), device=x.device) - starts[assigned[order]]
            order = order[rank < cap]
            counts = counts.clamp(max=cap)
        token = order // k  # (N,) source token of each kept assignment
        out = self.experts(flat[token], counts)  # (N, dim)
        out = out * r.weights.flatten()[order, None].to(out.dtype)
        y = torch.zeros_like(flat).index_add_(0, token, out.to(flat.dtype)).view(b, s, d)
        if self.shared is not None:
            y = y + self.shared(x)  # (b, s, dim): sequence-parallel like a dense SwiGLU
        if self.training:
            self._track(r, b, s)
        else:
            self.aux_loss = None
        return y  # (batch, seq, dim)

    def _track(self, r: Routing, b: int, s: int) -> None:
        """Accumulate this micro-batch's expert loads; compute its auxiliary losses."""
        c = self.cfg
        replay = recompute.replaying()  # a recomputed forward: counted and used already
        if not replay:
            with torch.no_grad():
                routed = torch.bincount(r.experts.flatten(), minlength=c.n_routed_experts)
                routed = routed.float()
                self.counts = routed if self.counts is None else self.counts + routed
        # Built on a replay too, so that it stores what the first pass stored for backward.
        aux_loss = balance.aux_losses(
            r.scores.view(b, s, -1),  # (batch, seq, E)
            r.experts.view(b, s, -1),  # (batch, seq, k)
            r.logits,
            seq_alpha=c.moe_seq_aux_alpha,
            batch_alpha=c.moe_aux_alpha,
            z_weight=c.moe_z_loss,
            group=None if self.context is None else self.context.group,
            sequence=self.sequence,
        )
        if not replay:
            self.aux_loss = aux_loss
