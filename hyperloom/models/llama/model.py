"""Llama-3-family decoder, single-device code only (parallelism is applied from outside).

Pre-norm blocks x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)) (arXiv 2302.13971,
2407.21783), grouped-query attention (arXiv 2305.13245) with RoPE. Optional `model.qk_norm`
(Qwen3's layout, arXiv 2505.09388) bounds attention logits by the norm weights; optional
`model.dropout` (p = 0, Llama's setting, draws no random numbers). The memory-bound pieces are
`hyperloom.engine.ops` calls chosen by `self.ops`; given labels, `forward` returns the loss so
the fused head never materialises the logits. Parameter names follow Meta's code; `hf.py`
maps them to Hugging Face names.

The model is built on the meta device and materialised with `to_empty` + `init_weights(seed)`;
each parameter draws from a generator seeded by (seed, name), so a pipeline stage holding some
layers starts from exactly the single-device weights. Pipeline chunks are this class with
parts removed: layers sit in a ModuleDict keyed by global index, so names stay `layers.N...`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyperloom.config import ModelConfig
from hyperloom.engine import ops
from hyperloom.engine.fp8 import reset_fp8_state
from hyperloom.engine.ops import OpImpls
from hyperloom.models.shard import shard_of


@dataclass
class KVCache:
    """Pre-allocated keys and values for incremental decoding, one pair per layer.

    Each tensor is (batch, max_len, n_kv_heads, head_dim); positions [0, length) are filled.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, batch: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        head_dim = cfg.dim // cfg.n_heads
        shape = (batch, max_len, cfg.n_kv_heads, head_dim)
        return cls(
            k=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)],
            v=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)],
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def update(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v for positions [start, start+seq) and return all keys/values so far."""
        end = start + k.shape[1]
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]


class CoreAttention(nn.Module):
    """softmax(q kᵀ / √d) v over (batch, heads, seq, head_dim), causal, with dropout on the
    weights: a module of its own so that the runtime can recompute it (activation
    checkpointing's "core_attn", Korthikanti et al., arXiv 2205.05198 §5)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout
        self.ops = OpImpls()
        # Context parallelism (`parallel.context_parallel`): q, k, v hold this rank's part
        # of the sequence and the hook runs attention across the cp ranks; None without cp.
        self.context = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.context is not None:
            return self.context.attention(q, k, v, self._whole)
        return self._whole(q, k, v)

    def _whole(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return ops.attention(q, k, v, is_causal=True, impl=self.ops.attention, dropout_p=p)


def rope_tables_of(
    cfg: ModelConfig, rope_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (max_seq_len, rope_dim) of the config's RoPE: its scaling kind
    (`cfg.rope_kind`) and attention factor; uninitialised on the meta device."""
    if device.type == "meta":
        empty = torch.empty(cfg.max_seq_len, rope_dim, device=device)
        return empty, empty.clone()
    inv = ops.scaled_inv_freq(
        cfg.rope_kind,
        rope_dim,
        cfg.rope_theta,
        cfg.rope_scaling,
        low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
        original_max_seq=cfg.rope_original_max_seq,
        beta_fast=cfg.yarn_beta_fast,
        beta_slow=cfg.yarn_beta_slow,
    )
    cos, sin = ops.rope_tables(inv, cfg.max_seq_len, cfg.rope_attention_factor)
    return cos.to(device), sin.to(device)


def rope_window(cos: torch.Tensor, sin: torch.Tensor, seq: int, context=None):
    """The RoPE rows of `seq` positions from tables that start at the first one: the first
    `seq` rows, or under context parallelism the rows of this rank's global positions."""
    if context is None:
        return cos[:seq], sin[:seq]
    return context.rope_rows(cos, sin, seq)


class SwiGLUAct(nn.Module):
    """silu(a) * b: the MLP's activation as a module, so that the runtime can drop its output
    after the down projection has used it and recompute it for the backward ("mlp_act")."""

    def __init__(self):
        super().__init__()
        self.ops = OpImpls()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ops.swiglu(a, b, self.ops.swiglu)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        # Head counts are read from the projections' shapes in forward, so tensor
        # parallelism (which leaves each rank a slice of the heads) needs no change here.
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # qk-norm (model.qk_norm): one RMSNorm over head_dim for all query heads, one for all
        # key heads, applied before RoPE as in Qwen3 (OLMo 2 normalises the whole projection).
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core_attention = CoreAttention(cfg.dropout)  # dropout on the weights, in training
        self.ops = OpImpls()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        q = self.wq(x).unflatten(-1, (-1, self.head_dim))  # (b, s, h, d)
        k = self.wk(x).unflatten(-1, (-1, self.head_dim))  # (b, s, kv, d)
        v = self.wv(x).unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        seq = q.shape[1]  # the full sequence, also when x arrives sequence-parallel
        cos, sin = rope_window(cos, sin, seq, self.core_attention.context)
        q, k = ops.rope(q, cos, sin, self.ops.rope), ops.rope(k, cos, sin, self.ops.rope)
        if cache is not None:
            k, v = cache.update(self.layer_id, start_pos, k, v)  # (b, start+s, kv, d)
        # SDPA wants (b, heads, s, d).
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if start_pos == 0:
            # Grouped-query attention inside SDPA: each kv head serves n_heads / n_kv_heads
            # consecutive query heads, without copying k and v for every query head.
            out = self.core_attention(q, k, v)
        elif seq == 1:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # sees everything
        else:
            # New block of queries after a cached prefix: query i sits at start_pos + i. With
            # an explicit mask, expand k/v so every backend (not only the math one) applies.
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            kv_len = k.shape[2]
            q_pos = torch.arange(start_pos, start_pos + seq, device=q.device)
            mask = q_pos[:, None] >= torch.arange(kv_len, device=q.device)[None, :]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).flatten(2)  # (b, s, h * d)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x) (Shazeer, arXiv 2002.05202)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.act = SwiGLUAct()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x)))


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich, arXiv 1910.07467), normalised in float32. Given a residual,
    normalises `residual + x` and also returns that sum (the fused add + norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = OpImpls()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual, self.ops.rmsnorm)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)
        self.dropout = cfg.dropout

    def forward(self, x, cos, sin, cache=None, start_pos=0):
        a = self.attention(self.attention_norm(x), cos, sin, cache, start_pos)
        a = residual_dropout(a, self.dropout, self.training)
        h, x = self.ffn_norm(a, residual=x)  # x <- x + a, h = norm(x), in one pass
        return x + residual_dropout(self.feed_forward(h), self.dropout, self.training)


def residual_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout on a branch's output before the residual add; the identity (no random
    numbers drawn) in evaluation or at p = 0."""
    return F.dropout(x, p) if training and p > 0 else x


class Llama(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab).

    As a pipeline stage (parts set to None): hidden states (batch, seq, dim) in, hidden
    states out unless the stage holds `norm` (and the head).
    """

    # The loss's reduction over labelled tokens (engine.ops.token_weights): the token mean.
    loss_reduction = "mean"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = self._rope_tables(torch.device("meta"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.ops = OpImpls()
        self.context = None  # context parallelism: weights the loss over the cp ranks

    def use_ops(self, impls: OpImpls) -> Llama:
        """Select the operator implementations for every module of the model."""
        return ops.use_ops(self, impls)

    def _rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables_of(self.cfg, self.cfg.dim // self.cfg.n_heads, device)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed`, independent of device and of how the model is split
        (tensor-parallel shards, pipeline stages).

        Normal(0, init_std) for embeddings and input projections; output projections (wo, w2)
        use init_std / sqrt(2 * n_layers) so the residual stream's variance does not grow
        with depth (GPT-2, Radford et al. 2019). Norm weights start at one.
        """
        c = self.cfg
        out_std = c.init_std / math.sqrt(2 * c.n_layers)
        for name, p in self.decoder_parameters():
            gen = param_generator(seed, name)
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = out_std if name.endswith(("wo.weight", "w2.weight")) else c.init_std
            draw_normal(p, gen, std)
        self.rope_cos, self.rope_sin = self._rope_tables(self.rope_cos.device)

    def decoder_parameters(self):
        """(name, parameter) that `init_weights`'s rule draws: all of them here; a
        vision-language model draws its encoder and projector by their own rule."""
        return self.named_parameters()

    def materialize(self, device: torch.device, seed: int) -> Llama:
        """Allocate storage on `device` (from the meta device) and initialise from `seed`.
        FP8 linears swapped in on the meta device get empty amax histories and unit scales:
        `to_empty` leaves buffers uninitialised."""
        self.to_empty(device=device)
        self.init_weights(seed)
        reset_fp8_state(self)
        return self

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (b, s, vocab); or, given labels (b, s), the mean cross-entropy (float32)."""
        h = self.embed(tokens, start_pos)  # (b, s, dim)
        # From start_pos on; attention cuts them to its (whole, gathered) sequence length.
        cos, sin = self.rope_cos[start_pos:], self.rope_sin[start_pos:]  # (max - start, d)
        for layer in self.layers.values():
            h = layer(h, cos, sin, cache, start_pos)
        if self.norm is None:
            return h  # a pipeline stage before the last
        h = self.norm(h)
        if labels is not None:
            return self.loss(h, labels)
        if self.output is None:  # tied: the embedding matrix is the head
            return F.linear(h, self.tok_embeddings.weight)  # (b, s, vocab)
        return self.output(h)  # (b, s, vocab), or a vocab shard under tensor parallelism

    def embed(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """The first block's input: `stage_input` (a vision-language model adds images)."""
        return stage_input(self, tokens, start_pos)

    def loss(
        self, h: torch.Tensor, labels: torch.Tensor, whole_sequence: bool = False
    ) -> torch.Tensor:
        """Mean next-token cross-entropy of the head on final hidden states h (b, s, dim).
        `whole_sequence`: h holds whole sequences even under sequence parallelism (DeepSeek's
        MTP)."""
        parallel_loss = getattr(self.output, "loss", None)
        reduction = self.loss_reduction
        if parallel_loss is not None:  # a vocab-parallel head brings its own (tensor_parallel)
            loss = parallel_loss(
                h, labels, self.ops.cross_entropy, self.ops.ce_chunk_tokens, whole_sequence,
                reduction,
            )  # fmt: skip
        else:
            weight = self.tok_embeddings.weight if self.output is None else self.output.weight
            loss = ops.linear_cross_entropy(
                h,
                weight,
                labels,
                chunk_tokens=self.ops.ce_chunk_tokens,
                impl=self.ops.cross_entropy,
                reduction=reduction,
            )
        if self.context is not None:  # the mean over the cp ranks is the sequence's mean
            loss = self.context.weight_loss(loss, labels)
        return loss


def stage_input(model: nn.Module, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Token ids (b, s) -> embeddings (b, s, dim), checking the positions against
    model.max_seq_len. A floating-point input is the hidden state a previous pipeline stage
    produced and passes through, (b, s, dim) or (b, s / tp, dim) under sequence parallelism
    (a tied last stage holds the embedding only as its head)."""
    if tokens.is_floating_point():
        return tokens
    seq = tokens.shape[1]
    if start_pos + seq > model.cfg.max_seq_len:
        raise ValueError(
            f"positions {start_pos}..{start_pos + seq - 1} exceed model.max_seq_len "
            f"({model.cfg.max_seq_len})"
        )
    return model.tok_embeddings(tokens)


@torch.no_grad()
def draw_normal(p: torch.Tensor, gen: torch.Generator, std: float) -> None:
    """Fill `p` with Normal(0, std) drawn from `gen` on CPU, as the whole tensor would be.

    A sharded parameter (tensor-parallel slice, or an expert-parallel rank's experts) says
    which slice of the full tensor it is; drawing the full tensor and keeping the slice makes
    every layout start from the weights of the single-device model. Drawn on CPU so the
    device's RNG does not matter.
    """
    shard = shard_of(p)
    shape = list(p.shape) if shard is None else shard.whole_shape(p.shape)
    full = torch.randn(shape, generator=gen, dtype=torch.float32) * std
    p.copy_(full if shard is None else shard.piece(full))


def param_generator(seed: int, name: str) -> torch.Generator:
    """CPU generator for parameter `name`: a function of (seed, name) only (see init_weights).

    Torch's CPU generator keeps 32 bits of its seed, so (seed, name) is hashed to 32 bits.
    """
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=4).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little"))
