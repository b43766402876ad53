"""What one transformer layer does on one rank: GEMMs, attention, memory traffic, saved tensors.

A `ModelSpec` (from a job's `ModelConfig`) yields a `Layer`: per-rank GEMM shapes, attention
FLOPs, bytes moved by memory-bound kernels, tensors saved for backward (each tagged with the
recompute module that drops it) and collective buffers. `costs.py` and `memory.py` both read
it, so they never disagree about a shape.

Saved tensors follow Korthikanti et al. (arXiv 2205.05198 §4). For GPT the list sums to their
sbh(10 + 24/t + 5as/(ht)) without SP and sbh(34 + 5as/h)/t with it; for a Llama layer with SP

    sb[8h + 4q + 4kv + 6f]/t + 4sb*heads/t (the flash log-sum-exp, fp32),

33.5sbh/t for Llama 3 70B, plus 2sb(q + kv)/t + 4sb(heads + kv heads)/t with qk-norm.
hyperloom's runtime saves SP's gathered linear inputs (`sharded_save=False`), 2sbh per input
instead of Megatron's 2sbh/t. Recompute modules: ``core_attn``, ``mlp_act``, ``norm``;
``full`` keeps only the layer input. The DeepSeek family is one mean layer
(`_build_deepseek_layer`) that also carries the bytes of one expert dispatch.

The vision-language family ("vlm", LLaVA-style) is its decoder (llama or deepseek, costed
as that family) plus a ViT encoder and a projector on the first pipeline stage: one encoder
block for a micro-batch's images is a `Layer` too (`build_vision_block`: LayerNorms, biased
q/k/v/out and fc1/fc2 split over tp, bidirectional attention within each image, whole image
sequences under sp); `planner/vision.py` costs the tower.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from dataclasses import dataclass

from hyperloom.config import ModelConfig, recompute_policy
from hyperloom.config.models.vlm import tokens_per_image, vision_feature_depth, vision_patches
from hyperloom.planner.errors import PlanError

log = logging.getLogger("hyperloom.planner")

FAMILIES = ("llama", "deepseek", "vlm")
# `train.freeze` parts of a vision-language model (`hyperloom.models.freeze.PARTS`), each
# with parameter names standing for it: a glob freezes a part when it matches all of them.
FREEZE_PARTS = {
    "vision": (
        "vision.patch_embedding.weight",
        "vision.position_embedding.weight",
        "vision.layers.0.self_attn.q_proj.weight",
        "vision.layers.0.mlp.fc1.weight",
        "vision.layers.0.layer_norm1.weight",
    ),
    "projector": ("projector.linear_1.weight", "projector.linear_2.weight"),
    "decoder": (
        "tok_embeddings.weight",
        "layers.0.attention.wq.weight",
        "layers.0.feed_forward.w1.weight",
        "norm.weight",
        "output.weight",
    ),
}


def _read(field: str, doc: str) -> property:
    """A shape the spec reads from its `ModelConfig` (the one place it is set)."""
    return property(lambda self: getattr(self.config, field), doc=doc)


def _deepseek(field: str, doc: str, dense: int = 0) -> property:
    """A DeepSeek (MoE, MLA, MTP) shape read from the config; `dense` for other families."""
    return property(lambda self: getattr(self.config, field) if self.mla else dense, doc=doc)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as the planner costs it: the shapes of `config`, the same
    `ModelConfig` that `hyperloom train` builds (dense Llama, or DeepSeek's MoE, MLA and
    MTP), plus what the config cannot say -- the architecture of the published GPT runs
    (`published.gpt`: GeLU MLP, LayerNorm, biases, dropout, no flash attention) and the
    load imbalance assumed for expert parallelism. The shapes are read-only properties, so
    a spec and the config it was built from cannot disagree."""

    config: ModelConfig
    name: str = ""  # default: the config's preset
    gated_mlp: bool = True  # SwiGLU (three matrices) or GeLU (two)
    norm: str = "rms"  # "rms" or "layer"
    bias: bool = False
    dropout: bool = False  # dropout masks saved for the backward (the 2022 GPT runs)
    flash_attention: bool = True
    # Tokens on the busiest expert-parallel rank over the mean (applies only when ep > 1;
    # at ep = 1 one grouped GEMM runs tokens x top_k rows whatever the routing). It scales
    # the expert GEMM rows, the received all-to-all bytes and the dispatch buffers of every
    # rank, since an all-to-all waits for its busiest member. 1.25: an assumption, not a
    # measurement (docs/planner.md shows the sensitivity).
    moe_imbalance: float = 1.25
    # Vision-language models: images per sample (per sequence), and the job's
    # `train.freeze` (parts, or globs that cover whole parts; `frozen`). One image per
    # sample is `hyperloom.models.vlm.accounting`'s assumption (LLaVA's common case);
    # `data.max_images` is the batch's image slots, a cap, not a count.
    images_per_sample: float = 1.0
    freeze: tuple[str, ...] = ()

    n_layers = _read("n_layers", "transformer blocks")
    dim = _read("dim", "hidden size")
    n_heads = _read("n_heads", "query heads")
    n_kv_heads = _read("n_kv_heads", "key/value heads")
    ffn_dim = _read("ffn_dim", "dense MLP width")
    vocab_size = _read("vocab_size", "vocabulary")
    tie_embeddings = _read("tie_embeddings", "output head shares the input embedding")
    qk_norm = _read("qk_norm", "RMSNorm over head_dim on each query and key head")
    family = _read("family", "model family: llama, deepseek or vlm")
    n_routed_experts = _deepseek("n_routed_experts", "routed experts per MoE layer")
    n_shared_experts = _deepseek("n_shared_experts", "shared experts per MoE layer")
    moe_top_k = _deepseek("moe_top_k", "routed experts per token")
    moe_ffn_dim = _deepseek("moe_ffn_dim", "one expert's SwiGLU width")
    q_lora_rank = _deepseek("q_lora_rank", "MLA query latent (0: plain query projection)")
    kv_lora_rank = _deepseek("kv_lora_rank", "MLA key/value latent")
    qk_nope_head_dim = _deepseek("qk_nope_head_dim", "MLA query/key width without RoPE")
    qk_rope_head_dim = _deepseek("qk_rope_head_dim", "MLA decoupled RoPE width")
    v_head_dim = _deepseek("v_head_dim", "MLA value width per head")
    mtp_depth = _deepseek("mtp_depth", "multi-token prediction modules")
    # group-limited routing: experts in moe_n_groups groups, a token routed within its best
    # moe_topk_groups (DeepSeek-V3: 8 groups = 8 nodes of 32 experts, at most 4 nodes)
    moe_n_groups = _deepseek("moe_n_groups", "expert groups", dense=1)
    moe_topk_groups = _deepseek("moe_topk_groups", "groups a token may use", dense=1)

    def __post_init__(self) -> None:
        if self.config.family not in FAMILIES:
            raise PlanError(
                f"the planner models the {', '.join(FAMILIES)} families only, "
                f"got {self.config.family!r}"
            )
        if not self.name:
            object.__setattr__(self, "name", self.config.preset)
        # read on every cost of a search: computed once (the config is frozen)
        vision = self.config.family == "vlm"
        decoder = self.config.vlm_decoder if vision else self.config.family
        object.__setattr__(self, "_vision", vision)
        object.__setattr__(self, "_mla", decoder == "deepseek")
        object.__setattr__(self, "freeze", tuple(self.freeze))
        object.__setattr__(self, "_frozen", self._frozen_parts())
        if self.vision:
            self._check_vision()
        if min(self.n_layers, self.dim, self.n_heads, self.n_kv_heads, self.ffn_dim) < 1:
            raise PlanError(f"model {self.name}: every size must be positive")
        if self.mla:
            return
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise PlanError(
                f"model {self.name}: dim ({self.dim}) must divide by heads ({self.n_heads}) "
                f"and heads by kv heads ({self.n_kv_heads})"
            )

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, name: str | None = None) -> ModelSpec:
        """The spec of a training job's model (`name` defaults to its preset), with the
        expert-parallel load it assumes (`model.moe_imbalance`)."""
        return cls(cfg, name or cfg.preset, moe_imbalance=cfg.moe_imbalance)

    @classmethod
    def from_job(cls, job, name: str | None = None) -> ModelSpec:
        """The spec of a `JobConfig`'s model with its `train.freeze` (one image per sample:
        see `images_per_sample`) and `model.moe_imbalance`."""
        freeze = tuple(getattr(job.train, "freeze", ()) or ())
        model = job.model
        return cls(model, name or model.preset, freeze=freeze, moe_imbalance=model.moe_imbalance)

    # ------------------------------------------------------------------ frozen parts
    def _frozen_parts(self) -> frozenset[str]:
        """The parts `freeze` names, or that a glob covers whole; a glob covering part of
        one is costed as trainable (with a warning), as is any entry for another family."""
        if not self.freeze:
            return frozenset()
        if not self.vision:
            log.warning(
                "train.freeze = %s: the planner costs frozen parts of a vlm only; %s is costed "
                "as fully trainable",
                list(self.freeze),
                self.name,
            )
            return frozenset()
        parts = set()
        for entry in self.freeze:
            if entry in FREEZE_PARTS:
                parts.add(entry)
                continue
            whole = [
                p for p, names in FREEZE_PARTS.items()
                if all(fnmatch.fnmatchcase(n, entry) for n in names)
            ]  # fmt: skip
            if whole:
                parts.update(whole)
            else:
                log.warning(
                    "train.freeze pattern %r: the planner freezes whole parts (vision, "
                    "projector, decoder) only; costed as trainable",
                    entry,
                )
        if parts == set(FREEZE_PARTS):
            raise PlanError(f"train.freeze = {list(self.freeze)} freezes every parameter")
        return frozenset(parts)

    def frozen(self, part: str) -> bool:
        """Whether `part` (vision, projector, decoder) has no gradients or optimizer state."""
        return part in self._frozen  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ vision (vlm)
    @property
    def vision(self) -> bool:
        """A vision-language model: encoder and projector before the decoder."""
        return self._vision  # type: ignore[attr-defined]

    def _check_vision(self) -> None:
        c = self.config
        if min(c.vision_dim, c.vision_heads, c.vision_ffn_dim, c.image_size, c.patch_size) < 1:
            raise PlanError(f"model {self.name}: every vision size must be positive")
        if c.vision_dim % c.vision_heads:
            raise PlanError(
                f"model {self.name}: vision_dim ({c.vision_dim}) must divide by vision_heads "
                f"({c.vision_heads})"
            )
        if not 1 <= self.vision_depth <= c.vision_layers:
            raise PlanError(
                f"model {self.name}: vision_feature_layer {c.vision_feature_layer} picks none "
                f"of the {c.vision_layers} encoder blocks"
            )
        if self.images_per_sample < 0:
            raise PlanError(f"images_per_sample must be >= 0, got {self.images_per_sample}")

    vision_dim = _read("vision_dim", "ViT width")
    vision_heads = _read("vision_heads", "ViT attention heads")
    vision_ffn_dim = _read("vision_ffn_dim", "ViT MLP width")
    vision_layers = _read("vision_layers", "ViT blocks built (the unused ones frozen)")

    @property
    def vision_depth(self) -> int:
        """Encoder blocks that run (up to the feature layer)."""
        return vision_feature_depth(self.config)

    @property
    def vision_patches(self) -> int:
        """Patches per image (side squared)."""
        return vision_patches(self.config) ** 2

    @property
    def vision_positions(self) -> int:
        """Positions the encoder runs on per image: patches and the class token."""
        return self.vision_patches + (1 if self.config.vision_class_token else 0)

    @property
    def tokens_per_image(self) -> int:
        """Decoder positions (and projector rows) one image takes."""
        return tokens_per_image(self.config)

    @property
    def projector_in(self) -> int:
        """The projector's input width (vision_dim x pixel_shuffle squared)."""
        return self.vision_dim * self.config.pixel_shuffle**2

    @property
    def projector_mlp(self) -> bool:
        return self.config.projector == "mlp"

    def vision_block_params(self, tp: int = 1) -> float:
        """One encoder block on one of `tp` ranks: q, k, v, fc1 (with biases) and out, fc2
        split; the row-parallel biases and the LayerNorms whole on every rank."""
        d, f, t = self.vision_dim, self.vision_ffn_dim, tp
        split = 4 * d * d + 3 * d + 2 * d * f + f
        return split / t + 2 * d + 4 * d

    def vision_block_matmul(self) -> int:
        """Matrices of one encoder block."""
        d = self.vision_dim
        return 4 * d * d + 2 * d * self.vision_ffn_dim

    def vision_embed_params(self) -> int:
        """Patch and position embeddings, class token, pre- and post-norm (replicated)."""
        c, d = self.config, self.vision_dim
        n = 3 * c.patch_size**2 * d + (d if c.vision_patch_bias else 0)
        n += (d if c.vision_class_token else 0) + self.vision_positions * d
        return n + (2 * d if c.vision_pre_norm else 0) + 2 * d

    def projector_params(self, tp: int = 1) -> float:
        """The projector on one of `tp` ranks: an MLP's linear_1 by columns (with its bias),
        linear_2 by rows (its bias whole); one linear runs replicated."""
        bias = 1 if self.config.projector_bias else 0
        h = self.dim
        if not self.projector_mlp:
            return self.projector_in * h + bias * h
        return (self.projector_in * h + bias * h + h * h) / tp + bias * h

    def vision_params(self, tp: int = 1) -> tuple[float, float]:
        """(encoder + projector, of which frozen) parameters on one of `tp` ranks: the
        blocks above the feature layer and the final LayerNorm are always frozen."""
        if not self.vision:
            return 0.0, 0.0
        d = self.vision_dim
        block = self.vision_block_params(tp)
        encoder = self.vision_embed_params() + self.vision_layers * block
        projector = self.projector_params(tp)
        if self.frozen("vision"):
            frozen = encoder
        else:
            frozen = (self.vision_layers - self.vision_depth) * block + 2 * d
        return encoder + projector, frozen + (projector if self.frozen("projector") else 0.0)

    def vision_forward_flops_per_image(self) -> float:
        """Forward FLOPs of the encoder's running blocks (bidirectional attention over the
        positions), the patch embedding and the projector, for one image."""
        n, d = self.vision_positions, self.vision_dim
        blocks = self.vision_depth * (2 * self.vision_block_matmul() * n + 4 * n * n * d)
        patch = 2 * 3 * self.config.patch_size**2 * d * self.vision_patches
        proj = self.projector_in * self.dim + (self.dim * self.dim if self.projector_mlp else 0)
        return blocks + patch + 2 * proj * self.tokens_per_image

    def vision_flops_per_image(self) -> float:
        """Training FLOPs of one image, three times the forward whatever is frozen (the
        model-FLOPs convention: `hyperloom.models.vlm.accounting.
        vision_training_flops_per_image`)."""
        return 3 * self.vision_forward_flops_per_image()

    def with_config(self, **changes) -> ModelSpec:
        """This spec with `changes` to its model config (shapes change only there)."""
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **changes))

    @property
    def n_dense_layers(self) -> int:
        """Leading layers with the dense FFN (all of them for a DeepSeek without experts)."""
        if not self.mla:
            return 0
        return self.config.n_dense_layers if self.config.n_routed_experts else self.n_layers

    @property
    def decoder_family(self) -> str:
        """The language model's family: the family, or a vlm's decoder (llama, deepseek)."""
        return self.config.vlm_decoder if self.vision else self.family

    @property
    def mla(self) -> bool:
        """The DeepSeek decoder (MLA, MoE, MTP), also as a vlm's decoder."""
        return self._mla  # type: ignore[attr-defined]

    @property
    def n_moe_layers(self) -> int:
        return (self.n_layers - self.n_dense_layers) if self.n_routed_experts else 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.qk_head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        return self.n_heads * (self.v_head_dim if self.mla else self.head_dim)

    # DeepSeek bookkeeping, the same sums as hyperloom/models/deepseek/accounting.py.
    def _mla_matmul(self) -> int:
        h, q = self.dim, self.q_dim
        wq = h * self.q_lora_rank + self.q_lora_rank * q if self.q_lora_rank else h * q
        wkv = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        wkv += self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return wq + wkv + self.v_dim * h

    def _ffn_matmul(self, moe: bool, routed: int) -> int:
        if not moe:
            return 3 * self.dim * self.ffn_dim
        experts = (routed + self.n_shared_experts) * 3 * self.dim * self.moe_ffn_dim
        return self.n_routed_experts * self.dim + experts

    def _block_matmul(self, moe: bool, routed: int) -> int:
        return self._mla_matmul() + self._ffn_matmul(moe, routed)

    def _block_extras(self, moe: bool) -> int:
        return (
            2 * self.dim
            + self.q_lora_rank
            + self.kv_lora_rank
            + (self.n_routed_experts if moe else 0)
        )

    def _layers_params(self) -> int:
        """All decoder layers of the main model (matrices and norms)."""
        if not self.mla:
            return self.n_layers * self.layer_params()
        E, n_moe = self.n_routed_experts, self.n_moe_layers
        dense = (self.n_layers - n_moe) * (self._block_matmul(False, 0) + self._block_extras(False))
        return dense + n_moe * (self._block_matmul(True, E) + self._block_extras(True))

    def mtp_params(self) -> int:
        """MTP modules (one block + eh_proj + norms each; embedding and head shared)."""
        moe = bool(self.n_routed_experts)
        block = self._block_matmul(moe, self.n_routed_experts) + self._block_extras(moe)
        return self.mtp_depth * (block + 2 * self.dim * self.dim + 3 * self.dim)

    def chunk_layer_params(self, start: int, n: int) -> tuple[float, float]:
        """(parameters, of which routed-expert matrices) of the `n` consecutive layers from
        layer `start`: the model's first `n_dense_layers` are dense (DeepSeek-V3 puts them
        first, and Megatron-Core's `moe_layer_freq` does), so a pipeline's first chunks hold
        them and its later ones more experts than the mean layer says (the states of a
        stage; the time model keeps the mean layer)."""
        if not self.mla:
            return n * self.layer_params(), 0.0
        dense = max(0, min(start + n, self.n_layers - self.n_moe_layers) - start)
        moe = n - dense
        d = dense * (self._block_matmul(False, 0) + self._block_extras(False))
        m = moe * (self._block_matmul(True, self.n_routed_experts) + self._block_extras(True))
        return float(d + m), float(moe * self.routed_expert_params())

    def weight_shapes_params(self) -> float:
        """Elements of one of each distinct weight matrix of the decoder layers: a layer's
        matrices (dense Llama), or MLA's, a dense FFN's when the model has dense layers, the
        shared experts' and one routed expert's (DeepSeek). What TE's per-shape dummy weight
        gradients hold (`Runtime.te_dummy_wgrad`)."""
        if not self.mla:
            return self.layer_matmul_params()
        out = self._mla_matmul() + (3 * self.dim * self.ffn_dim if self.n_dense_layers else 0)
        if self.n_routed_experts:
            out += (self.n_shared_experts + 1) * 3 * self.dim * self.moe_ffn_dim
        return float(out)

    def routed_expert_params(self) -> int:
        """Matrices of the routed experts of one MoE layer (what expert parallelism shards)."""
        return self.n_routed_experts * 3 * self.dim * self.moe_ffn_dim

    def layer_expert_params(self) -> float:
        """Routed-expert matrices of the mean layer (the share of `layer_params` ep shards)."""
        return self.n_moe_layers * self.routed_expert_params() / self.n_layers

    def mtp_expert_params(self) -> int:
        """Routed-expert matrices of the MTP modules (each has one MoE block)."""
        return self.mtp_depth * self.routed_expert_params()

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def layer_matmul_params(self) -> float:
        """Matrices of one layer (all experts); the mean over layers for the DeepSeek family."""
        if self.mla:
            n_moe, E = self.n_moe_layers, self.n_routed_experts
            dense = (self.n_layers - n_moe) * self._block_matmul(False, 0)
            return (dense + n_moe * self._block_matmul(True, E)) / self.n_layers
        attn = self.dim * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.dim
        return attn + self.mlp_matrices * self.dim * self.ffn_dim

    def layer_params(self) -> float:
        """Matrices, biases and norm weights of one layer (the mean for the DeepSeek family)."""
        if self.mla:
            return self._layers_params() / self.n_layers
        n = self.layer_matmul_params() + (2 if self.norm == "rms" else 4) * self.dim
        n += 2 * self.head_dim if self.qk_norm else 0
        if self.bias:
            n += self.q_dim + 2 * self.kv_dim + self.dim + (self.mlp_matrices - 1) * self.ffn_dim
            n += self.dim
        return n

    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    def params(self) -> int:
        """Every parameter: the decoder's, and a vlm's encoder and projector."""
        head = 0 if self.tie_embeddings else self.embedding_params()
        layers = self._layers_params() + self.mtp_params()
        return layers + self.embedding_params() + head + self.dim + self.vision_params()[0]

    def matmul_params(self) -> int:
        """Weights in a matmul per token: every layer's linears plus the output head; for
        MoE the top-k routed experts only, MTP blocks and one head per prediction depth."""
        if self.mla:
            k, n_moe, d = self.moe_top_k, self.n_moe_layers, self.mtp_depth
            main = (self.n_layers - n_moe) * self._block_matmul(False, 0)
            main += n_moe * self._block_matmul(True, k)
            moe = bool(self.n_routed_experts)
            mtp = d * (self._block_matmul(moe, k) + 2 * self.dim * self.dim)
            return main + mtp + (1 + d) * self.embedding_params()
        return self.n_layers * self.layer_matmul_params() + self.embedding_params()

    def model_flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token, Megatron/PaLM convention (full attention matrix): the
        same number as `hyperloom.models.llama.accounting.training_flops_per_token` (and
        the deepseek accounting's: activated parameters, MTP included; and for a vlm
        `hyperloom.models.vlm.accounting`'s: the encoder's FLOPs of `images_per_sample`
        images spread over the sequence, frozen parts counted like the rest)."""
        attn = 6.0 * seq * (self.q_dim + self.v_dim)
        dec = 6.0 * self.matmul_params() + (self.n_layers + self.mtp_depth) * attn
        if self.vision:
            dec += self.images_per_sample * self.vision_flops_per_image() / seq
        return dec


@dataclass(frozen=True)
class Gemm:
    """One forward GEMM on one rank: (m x k) @ (k x n), `count` times (batched heads)."""

    name: str
    m: float
    n: float
    k: float
    count: float = 1.0
    groups: float = 0.0  # a grouped GEMM's group count (the routed experts' local experts)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class Saved:
    """A tensor autograd keeps until the backward; `module` is the recompute group that drops
    it ("input" is the layer input that even full recompute keeps, "layer" goes only with
    full recompute); `gemm_input` tensors are stored in FP8 when FP8 is on."""

    name: str
    nbytes: float
    module: str
    gemm_input: bool = False
    also: str = ""  # a second module that drops it (the core's lse goes with mla_up too)


@dataclass(frozen=True)
class Layer:
    """One transformer layer for one micro-batch on one rank (see module docstring)."""

    gemms: tuple[Gemm, ...]
    attn_flops: float  # executed forward FLOPs of the attention core (causal halving applied)
    attn_gemms: tuple[Gemm, ...]  # the core as batched GEMMs when not flash attention
    elementwise_bytes: float  # forward bytes of memory-bound kernels outside the core
    norm_bytes: float  # the part of elementwise_bytes spent in the two norms
    act_bytes: float  # the part spent in the MLP activation function
    core_bytes: float  # forward bytes of the unfused softmax/mask/dropout (no flash)
    saved: tuple[Saved, ...]
    tp_buffer: float  # bytes of one TP collective's full buffer (b * s/cp * h * 2)
    # Context parallelism, in elements (the runtime's widths apply: `costs.context_comm`):
    # K and V of this rank's tokens, ring attention's block (b * s/cp * kv heads/tp *
    # (d_qk + d_v)); its FP32 output and log-sum-exp accumulators (b * s/cp * heads/tp *
    # (d_v + 1)); and the local q, k, v and output that Ulysses' all-to-alls move, k and v
    # repeated up to the query heads when their heads per tp rank do not divide by cp.
    cp_kv: float
    cp_acc: float
    cp_a2a: tuple[float, float, float, float]
    grad_out_bytes: float  # output-gradient bytes of the GEMMs (Zero Bubble's W keeps them)
    moe_fraction: float = 0.0  # share of the layers that are MoE (the mean layer's weight)
    expert_act_bytes: float = 0.0  # the routed experts' part of act_bytes ("experts" recompute)
    permute_bytes: float = 0.0  # the part spent permuting tokens to experts and back (MoE)
    seq: float = 0.0  # keys each query meets (the sequence), for calibrated attention
    head_dim: float = 0.0  # the attention's query/key head dim (its kernel's efficiency)
    # query heads per sequence of `seq` rows that this rank's attention kernel runs
    # (mbs x heads / tp / cp): its parallelism (`kernels.AttentionModel`); 0 = not modelled
    attn_heads: float = 0.0
    dispatch_bytes: float = 0.0  # one MoE layer's per-rank EP dispatch send buffer (ep > 1)
    # elements of the rows through this rank's routed experts, rows x dim (one MoE layer,
    # `moe_imbalance` included at ep > 1): what expert tensor parallelism without sp
    # all-reduces over etp (`costs.expert_parallel_comm`)
    routed_elements: float = 0.0
    # Without sp, the backward's TP all-reduces when they are not two of tp_buffer: DeepSeek's
    # MLA sums its latents' gradients (q_lora, kv_lora + rope columns), not the block input's.
    tp_grad_buffers: tuple[float, ...] = ()
    # Autocast per op: elements of the FP32 norm outputs cast to BF16, once per linear that
    # reads them, and of their gradients summed over those linears in the backward.
    cast_elements: float = 0.0
    cast_sum_elements: float = 0.0

    @property
    def gemm_flops(self) -> float:
        return sum(g.flops for g in self.gemms)


def build_layer(
    spec: ModelSpec,
    mbs: int,
    seq: int,
    tp: int,
    cp: int,
    sp: bool,
    sharded_save: bool = True,
    ep: int = 1,
    per_op_casts: bool = False,
    act_width: float = 2.0,
    latent_ring: bool = False,
    etp: int = 0,
) -> Layer:
    """The layer's work for `mbs` sequences of `seq` tokens split over cp and tp ranks.

    `per_op_casts` (`Runtime.autocast_per_op`): the norms keep the residual stream's FP32
    input for backward, and their FP32 output is cast to BF16 by autocast once per linear
    that reads it, each cast saved by its linear: three copies before q, k, v and two before
    a gated MLP's w1, w3 (measured with `saved_tensors_hooks` on our Llama: 10 B per token
    and model dimension more than one BF16 norm output each; dense layers only).
    `act_width` is bytes per activation element: 2 (BF16 autocast), 4 for a job trained in FP32
    (no autocast, so no casts: `per_op_casts` must be off). `etp`: the routed experts' width
    split (`Strategy.etp`; 0 = over tp), MoE only (`_build_deepseek_layer`)."""
    if per_op_casts and act_width != 2:
        raise PlanError("autocast casts per op are BF16 activations (act_width 2)")
    A = act_width  # noqa: N806 - bytes per activation element
    if spec.mla:
        return _build_deepseek_layer(
            spec, mbs, seq, tp, cp, sp, sharded_save, ep, act_width, latent_ring, etp
        )
    h, q, kv, f, a = spec.dim, spec.q_dim, spec.kv_dim, spec.ffn_dim, spec.n_heads
    t, tokens = tp, mbs * seq / cp  # tokens this rank owns along the sequence
    sp = sp and t > 1
    x_full = tokens * h  # elements of the hidden state of those tokens
    x_sp = x_full / t if sp else x_full  # in the regions between the blocks
    x_in = x_sp if (sp and sharded_save) else x_full  # stored inputs of column-parallel GEMMs
    n_fc1 = (2 if spec.gated_mlp else 1) * f
    gemms = (
        Gemm("qkv", tokens, (q + 2 * kv) / t, h),
        Gemm("out", tokens, h, q / t),
        Gemm("fc1", tokens, n_fc1 / t, h),
        Gemm("fc2", tokens, h, f / t),
    )
    heads = a / t
    # Causal attention over the whole sequence: each rank's queries meet all keys; with
    # load-balanced context parallelism every rank does 1/cp of the causal triangle.
    full_core = 4.0 * tokens * seq * q / t
    if spec.flash_attention:
        attn_flops, attn_gemms, core_bytes = full_core / 2, (), 0.0
        core_saved = (Saved("lse", 4 * tokens * heads, "core_attn"),)
    else:  # Megatron 2022: two batched GEMMs over the full s x s scores, unfused softmax
        attn_flops = full_core
        per = mbs * heads
        attn_gemms = (
            Gemm("scores", seq, seq, spec.head_dim, per),
            Gemm("context", seq, spec.head_dim, seq, per),
        )
        scores = per * seq * seq
        core_bytes = scores * (9.0 if spec.dropout else 4.0)
        core_saved = (Saved("softmax", A * scores, "core_attn"),)
        if spec.dropout:
            core_saved += (
                Saved("attn_dropout_mask", scores, "core_attn"),
                Saved("attn_dropout_out", A * scores, "core_attn"),
            )
    norm_in = 4 * x_sp if per_op_casts else A * x_sp
    qkv_copies = 3 if per_op_casts else 1
    fc1_copies = (2 if spec.gated_mlp else 1) if per_op_casts else 1
    # A norm's output is what "norm" recompute drops; under autocast per op the linears keep
    # their own BF16 casts of it instead, which it cannot drop (parallel.recompute).
    norm_out = "layer" if per_op_casts else "norm"
    saved = [
        Saved("norm1_in", norm_in, "input"),
        Saved("qkv_in", A * x_in * qkv_copies, norm_out, gemm_input=True),
        Saved("q", A * tokens * q / t, "layer"),
        Saved("k", A * tokens * kv / t, "layer"),
        Saved("v", A * tokens * kv / t, "layer"),
        *core_saved,
        Saved("out_in", A * tokens * q / t, "layer", gemm_input=True),
        Saved("norm2_in", norm_in, "layer"),
        Saved("fc1_in", A * x_in * fc1_copies, norm_out, gemm_input=True),
        Saved("fc1_out", A * tokens * n_fc1 / t, "layer"),
        Saved("fc2_in", A * tokens * f / t, "mlp_act", gemm_input=True),
    ]
    if spec.dropout:
        saved += [Saved("attn_out_mask", x_sp, "layer"), Saved("mlp_out_mask", x_sp, "layer")]
    if spec.qk_norm:  # the per-head norms' inputs and one fp32 1/rms per head row
        rows = tokens * (a + spec.n_kv_heads) / t
        saved.append(Saved("qk_norm_in", A * tokens * (q + kv) / t + 4 * rows, "layer"))
    act = (6.0 if spec.gated_mlp else 4.0) * tokens * f / t
    elementwise = (
        2 * 4.0 * x_sp  # two norms: read + write
        + 4.0 * tokens * (q + kv) / t  # RoPE on q and k
        + (4.0 * tokens * (q + kv) / t if spec.qk_norm else 0.0)  # qk-norms: read + write
        + 2 * 6.0 * x_sp  # two residual adds
        + act
        + (2 * 5.0 * x_sp if spec.dropout else 0.0)
    )
    grad_out = A * tokens * ((q + 2 * kv) / t + 2 * h + n_fc1 / t)
    kv_heads = spec.n_kv_heads // t
    kv_a2a = tokens * (kv if kv_heads % cp == 0 else q) / t  # repeated up to the query heads
    return Layer(
        gemms=gemms,
        attn_flops=attn_flops,
        attn_gemms=attn_gemms,
        elementwise_bytes=elementwise,
        norm_bytes=2 * 4.0 * x_sp,
        act_bytes=act,
        core_bytes=core_bytes,
        saved=tuple(saved),
        tp_buffer=A * x_full,
        cp_kv=2.0 * tokens * kv / t,
        cp_acc=tokens * (q + a) / t,
        cp_a2a=(tokens * q / t, kv_a2a, kv_a2a, tokens * q / t),
        grad_out_bytes=grad_out,
        seq=seq,
        head_dim=spec.head_dim,
        attn_heads=mbs * heads / cp,
        cast_elements=(qkv_copies + fc1_copies) * x_full if per_op_casts else 0.0,
        cast_sum_elements=(qkv_copies + fc1_copies - 2) * x_full if per_op_casts else 0.0,
    )


def build_vision_block(
    spec: ModelSpec,
    images: float,
    tp: int,
    per_op_casts: bool = False,
    act_width: float = 2.0,
) -> Layer:
    """One encoder block of a vlm for `images` images on one of `tp` ranks
    (`hyperloom.models.vlm.vision.VisionBlock`, `models/vlm/plan.py`): pre-norm LayerNorms,
    q, k, v (three GEMMs, biased) and fc1 column-parallel, out_proj and fc2 row-parallel, a
    two-matrix MLP (quick-GELU / GELU), flash attention without a causal mask within each
    image. The encoder runs on whole image sequences under sp (a `whole_sequence_module`):
    two all-reduces forward, two of the input gradients backward, nothing sequence-split.
    The saved tensors and recompute modules follow `build_layer`'s for a non-gated MLP.
    """
    if per_op_casts and act_width != 2:
        raise PlanError("autocast casts per op are BF16 activations (act_width 2)")
    A = act_width  # noqa: N806 - bytes per activation element
    d, f, t = spec.vision_dim, spec.vision_ffn_dim, tp
    n = spec.vision_positions
    rows = images * n  # positions of this micro-batch's images
    x = rows * d  # elements of the residual stream (whole on every tp rank)
    heads = spec.vision_heads / t
    gemms = (
        Gemm("v_qkv", rows, d / t, d, 3),  # q_proj, k_proj, v_proj: three linears
        Gemm("v_out", rows, d, d / t),
        Gemm("v_fc1", rows, f / t, d),
        Gemm("v_fc2", rows, d, f / t),
    )
    norm_in = 4 * x if per_op_casts else A * x
    qkv_copies = 3 if per_op_casts else 1
    norm_out = "layer" if per_op_casts else "norm"
    saved = (
        Saved("v_norm1_in", norm_in, "input"),
        Saved("v_qkv_in", A * x * qkv_copies, norm_out, gemm_input=True),
        Saved("v_q", A * rows * d / t, "layer"),
        Saved("v_k", A * rows * d / t, "layer"),
        Saved("v_v", A * rows * d / t, "layer"),
        Saved("v_lse", 4 * rows * heads, "core_attn"),
        Saved("v_out_in", A * rows * d / t, "layer", gemm_input=True),
        Saved("v_norm2_in", norm_in, "layer"),
        Saved("v_fc1_in", A * x, norm_out, gemm_input=True),
        Saved("v_fc1_out", A * rows * f / t, "layer"),
        Saved("v_fc2_in", A * rows * f / t, "mlp_act", gemm_input=True),
    )
    act = 4.0 * rows * f / t  # the activation function: read + write
    elementwise = (
        2 * 4.0 * x  # two LayerNorms
        + 2 * 6.0 * x  # two residual adds
        + act
        + (2 * 4.0 * x if t > 1 else 0.0)  # the row-parallel biases, added after the sum
    )
    return Layer(
        gemms=gemms,
        attn_flops=4.0 * rows * n * d / t,  # q kᵀ and p v over each image's n positions
        attn_gemms=(),
        elementwise_bytes=elementwise,
        norm_bytes=2 * 4.0 * x,
        act_bytes=act,
        core_bytes=0.0,
        saved=saved,
        tp_buffer=A * x,
        cp_kv=0.0,
        cp_acc=0.0,
        cp_a2a=(0.0, 0.0, 0.0, 0.0),
        grad_out_bytes=A * rows * (3 * d / t + 2 * d + f / t),
        seq=n,
        head_dim=spec.vision_dim / spec.vision_heads,
        cast_elements=(qkv_copies + 1) * x if per_op_casts else 0.0,
        cast_sum_elements=(qkv_copies - 1) * x if per_op_casts else 0.0,
    )


def _build_deepseek_layer(
    spec: ModelSpec,
    mbs: int,
    seq: int,
    tp: int,
    cp: int,
    sp: bool,
    sharded_save: bool,
    ep: int,
    act_width: float = 2.0,
    latent_ring: bool = False,
    etp: int = 0,
) -> Layer:
    """The mean DeepSeek layer: MLA plus, weighted by their share of the layers, the dense
    SwiGLU FFN of the first `n_dense_layers` and the MoE FFN of the rest (GEMM `count` and
    saved bytes carry the weights, so a chunk of n layers costs n means: exact in total,
    spread evenly over the pipeline instead of putting the dense layers on the first stage).

    MLA: the down-projections (wq_a, wkv_a) are replicated over tp, the up-projections and
    wo split by heads; attention with q/k head dim nope + rope and v head dim v_head_dim.
    MoE: the router GEMM (replicated), the shared experts as one SwiGLU of width
    shared x moe_ffn_dim split over tp, the routed experts as a grouped GEMM of E/ep experts
    with tokens x top_k / E rows each at ep = 1, and tokens x top_k x ep / E x
    `moe_imbalance` at ep > 1 (the ep ranks' routed copies meet on E/ep experts), each
    expert's width split over tp (or etp, below); dispatch/combine as permutation traffic.

    Expert parallelism: one dispatch all-to-all sends the routed copies of this rank's tokens,
    tokens x top_k x dim BF16 elements (over tp when tp > 1: each tensor-parallel rank sends
    its 1/tp share and the expert-tp group gathers them back, see `costs.layer_phase`).
    `act_width`: bytes per activation element, as in `build_layer`.

    Expert tensor parallelism (`etp`, e = etp or tp): each expert's width is split over e
    ranks (fe / e). With sp (and with etp unset, the Megatron layout whatever sp says) the
    rank routes its 1/tp slice of the tokens and its etp group gathers them: tokens x top_k
    x e / tp rows (at e = 1 the rank's own slice), dispatching 1/tp of the tokens at ep > 1;
    without sp every tp rank routes all of them, tokens x top_k rows, and at ep > 1
    dispatches them all (the other tp ranks do the same).

    `latent_ring` (ring context parallelism with wkv_b not in FP8,
    `hyperloom.parallel.context_parallel.RingAttention`): the ring passes the compressed
    latent [c_kv ‖ k_pe] (kv_lora_rank + rope per token, whole on every tp rank) instead of
    per-head K/V, saves it instead of K and V, and expands each block it holds with wkv_b:
    cp expansions forward (each step's block; counted whole) and again in backward.
    """
    h, a, t = spec.dim, spec.n_heads, tp
    A = act_width  # noqa: N806 - bytes per activation element
    tokens = mbs * seq / cp
    sp = sp and t > 1
    x_full = tokens * h
    x_sp = x_full / t if sp else x_full
    x_in = x_sp if (sp and sharded_save) else x_full
    qk, vd, rope = spec.qk_head_dim, spec.v_head_dim, spec.qk_rope_head_dim
    ql, kvl = spec.q_lora_rank, spec.kv_lora_rank
    q_dim, v_dim = a * qk, a * vd
    n_moe = spec.n_moe_layers
    wm = n_moe / spec.n_layers
    wd = 1.0 - wm
    gemms = []
    if ql:
        gemms += [Gemm("wq_a", tokens, ql, h), Gemm("wq_b", tokens, q_dim / t, ql)]
    else:
        gemms.append(Gemm("wq", tokens, q_dim / t, h))
    gemms += [
        Gemm("wkv_a", tokens, kvl + rope, h),
        Gemm("wkv_b", tokens, a * (spec.qk_nope_head_dim + vd) / t, kvl, cp if latent_ring else 1),
        Gemm("wo", tokens, h, v_dim / t),
    ]
    f = spec.ffn_dim
    if wd:
        gemms += [
            Gemm("fc1", tokens, 2 * f / t, h, wd),
            Gemm("fc2", tokens, h, f / t, wd),
        ]
    E, k, fe, S = spec.n_routed_experts, spec.moe_top_k, spec.moe_ffn_dim, spec.n_shared_experts
    e = etp or t  # the ranks splitting each routed expert's width
    gathered = sp or not etp  # each tp rank routes its 1/tp slice, gathered over e
    # tokens through this rank's experts: its etp group's slices, or all of them without sp
    routed_tokens = tokens / (t // e) if gathered else tokens
    routed_rows = routed_tokens * k  # rows through the routed experts of this rank (ep = 1)
    dispatch = 0.0
    if wm:
        local = E / ep
        if ep > 1:
            rows = routed_tokens * k * ep / E * spec.moe_imbalance
            dispatch = 2.0 * tokens * k * h / t if gathered else 2.0 * tokens * k * h
        else:
            rows = routed_tokens * k / E * 1.0
        routed_rows = rows * local
        gemms.append(Gemm("router", tokens, E, h, wm))
        if S:
            gemms += [
                Gemm("shared_fc1", tokens, 2 * S * fe / t, h, wm),
                Gemm("shared_fc2", tokens, h, S * fe / t, wm),
            ]
        gemms += [
            Gemm("experts_fc1", rows, 2 * fe / e, h, wm * local, local),
            Gemm("experts_fc2", rows, h, fe / e, wm * local, local),
        ]
    heads = a / t
    full_core = 2.0 * tokens * seq * (q_dim + v_dim) / t
    saved = [
        Saved("norm1_in", A * x_sp, "input"),
        Saved("attn_in", A * x_in, "norm", gemm_input=True),
        Saved("q_latent", A * tokens * (ql + ql), "layer", gemm_input=True),  # pre/post norm
        Saved("kv_latent", A * tokens * (2 * kvl + rope), "layer", gemm_input=True),
        Saved("q", A * tokens * q_dim / t, "mla_up"),
    ]
    if latent_ring:
        saved.append(Saved("latent", A * tokens * (kvl + rope), "mla_up"))
    else:
        saved += [
            Saved("k", A * tokens * q_dim / t, "mla_up"),
            # v is a slice of wkv_b's output, whose whole storage (k_nope too) stays with it
            Saved("v", A * tokens * a * (spec.qk_nope_head_dim + vd) / t, "mla_up"),
        ]
    saved += [
        Saved("lse", 4 * tokens * heads, "core_attn", also="mla_up"),
        Saved("out_in", A * tokens * v_dim / t, "layer", gemm_input=True),
        Saved("norm2_in", A * x_sp, "layer"),
        Saved("ffn_in", A * x_in, "norm", gemm_input=True),
    ]
    if wd:
        saved += [
            Saved("fc1_out", wd * A * tokens * 2 * f / t, "layer"),
            Saved("fc2_in", wd * A * tokens * f / t, "mlp_act", gemm_input=True),
        ]
    act = 6.0 * tokens * wd * f / t
    expert_act = 0.0  # the routed experts' share of `act`
    permute = router = 0.0
    if wm:
        shared = S * fe / t
        saved += [
            Saved("router_probs", wm * 4 * tokens * E * 2, "layer"),
            Saved("shared_fc1_out", wm * A * tokens * 2 * shared, "layer"),
            Saved("shared_fc2_in", wm * A * tokens * shared, "mlp_act", gemm_input=True),
            Saved("dispatched", wm * A * routed_rows * h, "layer", gemm_input=True),
            Saved("experts_fc1_out", wm * A * routed_rows * 2 * fe / e, "experts"),
            Saved("experts_fc2_in", wm * A * routed_rows * fe / e, "experts", gemm_input=True),
            Saved("experts_out", wm * A * routed_rows * h, "layer"),
        ]
        expert_act = wm * 6.0 * routed_rows * fe / e
        act += wm * 6.0 * tokens * shared + expert_act
        # router softmax/sigmoid + top-k (fp32); permute in and out, weighted combine
        permute = wm * (2 * 4.0 + 6.0) * routed_rows * h
        router = wm * 8.0 * tokens * E
    norms = 2 * 4.0 * x_sp + 4.0 * tokens * (ql + kvl)
    elementwise = (
        norms
        + 4.0 * tokens * (heads * rope + rope)  # RoPE on the rope parts of q and k
        + 2 * 6.0 * x_sp
        + act
        + permute
        + router
    )
    grad_out = sum(2.0 * g.m * g.n * g.count for g in gemms)
    return Layer(
        gemms=tuple(gemms),
        attn_flops=full_core / 2,
        attn_gemms=(),
        elementwise_bytes=elementwise,
        norm_bytes=norms,
        act_bytes=act,
        permute_bytes=permute,
        core_bytes=0.0,
        saved=tuple(saved),
        tp_buffer=A * x_full,
        # MLA: the compressed latent, or K and V per query head
        cp_kv=tokens * (kvl + rope) if latent_ring else tokens * (q_dim + v_dim) / t,
        cp_acc=tokens * (v_dim + a) / t,
        cp_a2a=(tokens * q_dim / t, tokens * q_dim / t, tokens * v_dim / t, tokens * v_dim / t),
        grad_out_bytes=grad_out,
        seq=seq,
        head_dim=qk,
        attn_heads=mbs * heads / cp,
        moe_fraction=wm,
        expert_act_bytes=expert_act,
        dispatch_bytes=dispatch,
        routed_elements=routed_rows * h if wm else 0.0,
        # hyperloom.models.deepseek.plan: wq_a's and wkv_a's output gradients (or wq's input
        # gradient without q_lora), then the FFN block's input gradient
        tp_grad_buffers=(2.0 * tokens * ql if ql else 2.0 * x_full, 2.0 * tokens * (kvl + rope))
        + (2.0 * x_full,),
    )


def parse_recompute(policy: str) -> tuple[bool, frozenset[str]]:
    """'none' | 'selective' | 'full' | 'core_attn,mlp_act,...' -> (full, modules): the
    runtime's policies (`config.recompute_policy`), a PlanError when unknown."""
    try:
        return recompute_policy(policy)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
