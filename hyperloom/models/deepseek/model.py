"""DeepSeek-V3-family decoder (V2, V2-Lite, V3), single-device code only.

Pre-norm blocks with Multi-head Latent Attention (`mla.MLA`) and a dense SwiGLU for the first
`n_dense_layers` layers, the MoE layer (`moe.MoE`) after them (arXiv 2412.19437 §2.1).

**Multi-token prediction** (V3 §2.2): module k combines the previous depth's hidden state with
the embedding of token t_{i+k},

    h′ᵏ_i = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(hᵏ⁻¹_i)]),   hᵏ = Blockₖ(h′ᵏ)

(the released checkpoint's concatenation order, the reverse of the paper's) and predicts
t_{i+k+1} through the shared head. The loss is L_main + (λ / D) Σ_k Lᵏ + Σ_layers L_aux; MTP
runs only in training. In pipeline runs the MTP modules live on the last stage with a copy of
the embedding whose gradient is summed with the first stage's.

`after_optimizer_step(group)` is the balancing hook the trainer calls: it all-reduces the
step's expert loads, moves the selection biases (`balance.update_bias`) and keeps the load
metrics. Init, meta-device construction and layer naming follow the Llama model.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyperloom.config import ModelConfig
from hyperloom.engine.ops import OpImpls
from hyperloom.models.deepseek import balance
from hyperloom.models.deepseek.mla import MLA, MLACache
from hyperloom.models.deepseek.moe import MoE
from hyperloom.models.llama.model import (
    FeedForward,
    Llama,
    RMSNorm,
    TransformerBlock,
    draw_normal,
    param_generator,
    rope_tables_of,
)

# Output projections into the residual stream: their init std is scaled by 1/sqrt(2 L).
_OUT_PROJ = ("wo.weight", "w2.weight", "w2", "eh_proj.weight")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = MLA(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if layer_id < cfg.n_dense_layers or not cfg.n_routed_experts:
            self.feed_forward: nn.Module = FeedForward(cfg.dim, cfg.ffn_dim)
        else:
            self.feed_forward = MoE(cfg)
        self.dropout = cfg.dropout

    # Llama's pre-norm residual block, residual dropout included, over MLA and the MoE.
    forward = TransformerBlock.forward


class MTPModule(Block):
    """One multi-token-prediction depth: a full block plus the input merge and its own norm."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def merge(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))  # (b, s, dim)


class DeepSeekV3(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); given labels, the training loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # MTP blocks continue the layer numbering (the checkpoint's `layers.61` for V3).
        self.mtp = nn.ModuleDict(
            {str(k): MTPModule(cfg, cfg.n_layers + k) for k in range(cfg.mtp_depth)}
        )
        cos, sin = self._rope_tables(torch.device("meta"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.ops = OpImpls()
        self.context = None  # context parallelism: weights the loss over the cp ranks
        # ... whose slot leaves the MTP modules on whole sequences (`_mtp_loss`)
        self.whole_sequence_modules = ("mtp",)
        self.sequence = None  # sequence parallelism: the MTP gathers its inputs over tp
        self.expert_load: dict[str, float] = {}  # layer -> max/mean load of the last step

    use_ops = Llama.use_ops  # select the operator implementations of every module
    materialize = Llama.materialize  # to_empty on `device`, then init_weights(seed)
    embed = Llama.embed  # the first block's input
    decoder_parameters = Llama.decoder_parameters  # what init_weights draws
    loss_reduction = Llama.loss_reduction

    def _rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables_of(self.cfg, self.cfg.qk_rope_head_dim, device)  # MLA's rope part

    def moe_layers(self) -> dict[str, MoE]:
        """Name -> MoE layer, main layers then MTP blocks."""
        return {
            n.removesuffix(".feed_forward"): m
            for n, m in self.named_modules()
            if isinstance(m, MoE)
        }

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std), output projections init_std / sqrt(2 L), norms one, biases 0;
        each parameter from its own (seed, name) generator, drawn on CPU (see Llama)."""
        c = self.cfg
        out_std = c.init_std / math.sqrt(2 * (c.n_layers + c.mtp_depth))
        for name, p in self.decoder_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("expert_bias"):
                p.zero_()
            else:
                std = out_std if name.endswith(_OUT_PROJ) else c.init_std
                draw_normal(p, param_generator(seed, name), std)
        self.rope_cos, self.rope_sin = self._rope_tables(self.rope_cos.device)

    def allocate_cache(
        self, batch: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> MLACache:
        """The compressed MLA cache for `generate` (main layers only)."""
        return MLACache.allocate(self.cfg, self.cfg.n_layers, batch, max_len, device, dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: MLACache | None = None,
        start_pos: int = 0,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (b, s, vocab); given labels (b, s), the mean loss (float32), in training
        plus the MTP and auxiliary balance losses."""
        h = self.embed(tokens, start_pos)  # (b, s, dim)
        if self.training:  # only this forward's auxiliary losses may reach the loss
            for m in self.moe_layers().values():
                m.aux_loss = None
        cos, sin = self.rope_cos[start_pos:], self.rope_sin[start_pos:]  # (max - start, rope)
        for layer in self.layers.values():
            h = layer(h, cos, sin, cache, start_pos)
        if self.norm is None:
            return h
        if labels is None:
            return self._head(self.norm(h))
        loss = self.loss(self.norm(h), labels)
        if self.training:
            if self.mtp:
                loss = loss + self._mtp_loss(h, labels, cos, sin)
            aux = [m.aux_loss for m in self.moe_layers().values() if m.aux_loss is not None]
            if aux:
                loss = loss + torch.stack(aux).sum()
        return loss

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)  # (b, s, vocab)
        return self.output(h)

    def _mtp_loss(
        self, h: torch.Tensor, labels: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """(λ / D) Σ_k Lᵏ over the D modules (see the module doc).

        The input tokens t_{i+k} are read from the labels (label i is token i + 1), so the
        MTP modules need no token ids: on the last pipeline stage they only have the labels.
        """
        whole = self.sequence is not None
        if whole:
            # Sequence parallelism: the MTP modules run tensor-parallel on whole sequences
            # (no sp), alike on every tp rank, so h's gradient is whole on each.
            h = self.sequence.gather(h)
        if self.context is not None:
            # Context parallelism: token i + k may sit on another rank, so every cp rank runs
            # the MTP modules on the whole sequences, gathered (their loss is then the same on
            # each, and the gather's backward sums h's gradient over the ranks).
            h, labels = self.context.gather_sequence(h), self.context.gather_sequence(labels)
        seq, depth = labels.shape[1], len(self.mtp)
        if whole:  # the sequence-parallel embedding returns slices: embed once, gather
            embedded = self.sequence.gather(self.tok_embeddings(labels))  # (b, seq, dim)
        losses = []
        for k, module in enumerate(self.mtp.values(), start=1):
            n = seq - k  # positions i with an input token t_{i+k} and a target t_{i+k+1}
            if n <= 0:
                break
            if whole:
                emb = embedded[:, k - 1 : k - 1 + n]
            else:
                emb = self.tok_embeddings(labels[:, k - 1 : k - 1 + n])  # (b, n, dim): t_{i+k}
            h = module(module.merge(emb, h[:, :n]), cos, sin)  # (b, n, dim)
            # targets t_{i+k+1}
            losses.append(self.loss(module.norm(h), labels[:, k:], whole_sequence=whole))
        if not losses:
            return torch.zeros((), device=h.device)
        return self.cfg.mtp_loss_weight / depth * torch.stack(losses).sum()

    loss = Llama.loss  # the shared head's mean cross-entropy (vocab-parallel under tp)

    def side_loss(self) -> torch.Tensor | None:
        """The auxiliary balance losses of the last training forward when that forward
        returned hidden states (a pipeline stage before the last): the pipeline executor adds
        them to the micro-batch's loss and its backward. None when there are none, or when the
        forward returned the loss, which holds them already."""
        if self.norm is not None or not self.training:
            return None
        aux = [m.aux_loss for m in self.moe_layers().values() if m.aux_loss is not None]
        return torch.stack(aux).sum() if aux else None

    @torch.no_grad()
    def after_optimizer_step(self, group=None) -> dict[str, float]:
        """Balance after an optimizer step: loads summed over `group` (data parallel; and
        over tp for layers on sequence slices), biases
        moved by ±moe_bias_rate, per-layer max/mean load kept in `expert_load` and returned."""
        layers = {n: m for n, m in self.moe_layers().items() if m.counts is not None}
        if not layers:
            return {}
        sliced = [m for m in layers.values() if m.sequence is not None]
        if sliced:  # sequence parallelism: each tp rank counted its slice of the tokens
            loads = torch.stack([m.counts for m in sliced])
            dist.all_reduce(loads, group=sliced[0].sequence.group)
            for m, load in zip(sliced, loads, strict=True):
                m.counts = load
        loads = balance.update_bias(
            [m.router.expert_bias for m in layers.values()],
            [m.counts for m in layers.values()],
            self.cfg.moe_bias_rate,
            group,
        )
        for m in layers.values():
            m.counts = None
        ratio = balance.load_imbalance(loads).tolist()
        self.expert_load = dict(zip(layers, ratio, strict=True))
        return self.expert_load
