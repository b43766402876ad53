"""Mixture-of-Experts feed-forward layer of the DeepSeek family: gate, experts, shared experts.

**Gate** (DeepSeek-V3, arXiv 2412.19437 §2.1.2; DeepSeek-V2, arXiv 2405.04434 §2.2). The router
computes affinities s = sigmoid(x Wᵀ) (V3) or softmax(x Wᵀ) (V2) in float32, whatever the
compute dtype, because a bf16 near-tie between two experts flips routing and gradients alike.
Selection uses the *biased* score s + b, where b is the auxiliary-loss-free balancing bias
(`hyperloom.models.deepseek.balance`); the gate *weights* use the unbiased s, so the bias steers
which experts a token visits but never how much each one contributes. Group-limited routing
splits the experts into `moe_n_groups` groups (one per node in V3), scores each group (sum of
its top-2 biased scores for sigmoid/V3's `noaux_tc`; its max for softmax/V2's
`group_limited_greedy`), keeps the best `moe_topk_groups` groups and takes the top-k experts
among them, so a token's experts live on at most that many nodes. The k weights are
renormalised to sum to one when `moe_norm_topk` (V3) and multiplied by `moe_route_scale`
(2.5 for V3, 16 for V2).

**Experts** hold their weights as (experts, out, in) tensors and run as one grouped GEMM over
tokens sorted by expert (`torch._grouped_mm`, which this PyTorch build has on CPU as well),
with a per-expert loop as the fallback. Under `precision.fp8` (`convert_to_fp8` calls
`enable_fp8`) the three expert GEMMs run in FP8 through the engine's grouped linear, each
expert with its own scales (DeepSeek-V3 §3.3: blockwise 1 x 128 token tiles and 128 x 128
weight blocks; delayed scaling: one amax history per expert, GEMM and role, as TE's grouped
linear keeps, in buffers with the expert dimension first so that expert parallelism splits and
checkpoints gather them like the weights); the router stays float32. The layer is dropless by
default (every expert takes every token routed to it, as in V3); a capacity factor c caps each
expert at ceil(c · tokens · k / experts) assignments, keeping the earliest tokens (GShard,
arXiv 2006.16668) and dropping the rest — a dropped assignment simply contributes nothing, the
shared experts and the residual still carry the token.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyperloom.config import ModelConfig
from hyperloom.engine import ops
from hyperloom.engine.fp8 import Recipe
from hyperloom.engine.fp8.modules import Fp8State, active_recipe, fp8_grouped_linear
from hyperloom.engine.ops import OpImpls
from hyperloom.models.deepseek import balance
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


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: `torch._grouped_mm`'s backward
    rejects the stride-0 gradients that e.g. `.sum()` produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs forward and backward here (probed once per kind)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        # Ones, not random numbers: probing must not move the global RNG (a resumed run's
        # dropout masks would shift).
        x = torch.ones(5, 8, device=device_type, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 8, 16, device=device_type, dtype=dtype, requires_grad=True)
        offs = torch.tensor([2, 5], device=device_type, dtype=torch.int32)
        _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs)).sum().backward()
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class Experts(Fp8State, nn.Module):
    """E SwiGLU experts, weights (E, out, in); input tokens sorted by expert."""

    GEMMS = ("w1", "w3", "w2")  # delayed scaling: the column blocks of each expert's state

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.grouped_mm: bool | None = None  # None = use it where it works (grouped_mm_works)
        self.ops = OpImpls()
        self.recipe: Recipe | None = None  # FP8 GEMMs (enable_fp8)
        self.fp8_activation = False
        self.register_buffer("fp8_amax_history", None)  # delayed scaling only (enable_fp8)
        self.register_buffer("fp8_scale", None)

    def enable_fp8(self, recipe: Recipe, fp8_activation: bool = False) -> bool:
        """Run the expert GEMMs in FP8 with `recipe` (called by `convert_to_fp8`). Delayed
        scaling keeps one amax history per expert and GEMM for input, weight and
        grad_output, as TE's grouped linear does: `fp8_amax_history` (E, len, 9) and
        `fp8_scale` (E, 9), columns (w1, w3, w2) x (input, weight, grad_output), expert
        first so that expert parallelism splits them like the weights. Every recipe is
        taken (True)."""
        self._setup_fp8(recipe, len(self.GEMMS), fp8_activation, self.w1.device, self.w1.shape[0])
        return True

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, dim) holding counts[e] consecutive rows for expert e -> (N, dim)."""
        recipe = active_recipe(self.recipe) if self.recipe is not None else None
        if recipe is not None:
            sizes = counts.tolist()

            def fp8_mm(a: torch.Tensor, w: torch.Tensor, gemm: int) -> torch.Tensor:
                states = [self._states(recipe, gemm, e) for e in range(len(sizes))]
                return fp8_grouped_linear(
                    a, w, sizes, recipe, states=states, fp8_activation=self.fp8_activation
                )

            h = ops.swiglu(fp8_mm(x, self.w1, 0), fp8_mm(x, self.w3, 1), self.ops.swiglu)
            return fp8_mm(h, self.w2, 2)  # (N, dim)
        use = self.grouped_mm
        if use is None:
            use = grouped_mm_works(x.device.type, x.dtype)
        if use:
            offs = counts.cumsum(0).to(torch.int32)  # (E,) end row of each expert's tokens

            def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                out = torch._grouped_mm(a, w.to(a.dtype).transpose(-2, -1), offs=offs)
                return _ContiguousGrad.apply(out)

            return mm(ops.swiglu(mm(x, self.w1), mm(x, self.w3), self.ops.swiglu), self.w2)
        outs = []
        for e, xs in enumerate(x.split(counts.tolist())):
            if xs.shape[0]:
                h = ops.swiglu(F.linear(xs, self.w1[e]), F.linear(xs, self.w3[e]), self.ops.swiglu)
                outs.append(F.linear(h, self.w2[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, self.w2.shape[1])


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
        y = torch.zeros_like(flat).index_add_(0, token, out.to(flat.dtype))
        if self.shared is not None:
            y = y + self.shared(flat)
        self.aux_loss = None
        if self.training:
            self._track(r, b, s)
        return y.view(b, s, d)  # (batch, seq, dim)

    def _track(self, r: Routing, b: int, s: int) -> None:
        """Accumulate this micro-batch's expert loads; compute its auxiliary losses."""
        c = self.cfg
        with torch.no_grad():
            routed = torch.bincount(r.experts.flatten(), minlength=c.n_routed_experts).float()
            self.counts = routed if self.counts is None else self.counts + routed
        self.aux_loss = balance.aux_losses(
            r.scores.view(b, s, -1),  # (batch, seq, E)
            r.experts.view(b, s, -1),  # (batch, seq, k)
            r.logits,
            seq_alpha=c.moe_seq_aux_alpha,
            batch_alpha=c.moe_aux_alpha,
            z_weight=c.moe_z_loss,
        )
