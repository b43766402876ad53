"""What one transformer layer does on one rank: GEMMs, attention, memory traffic, saved tensors.

The planner sees a model as a `ModelSpec` (shapes only) and a layer as a `Layer`: the list of
GEMMs with their per-rank shapes, the attention core's FLOPs, the bytes that memory-bound
kernels move, the tensors autograd keeps for the backward (each tagged with the recompute
*module* that can drop it), and the buffers the tensor- and context-parallel collectives
move. `costs.py` turns a `Layer` into seconds and `memory.py` into bytes, so the two can
never disagree about a shape.

Saved tensors follow Korthikanti et al. (arXiv 2205.05198 §4), bytes for one micro-batch of
b sequences of s tokens with hidden size h on one of t tensor-parallel ranks (2 bytes per
16-bit element, 1 per dropout-mask element). For GPT (GeLU MLP of 4h, LayerNorm, dropout,
no flash attention) the list sums to their sbh(10 + 24/t + 5as/(ht)) without sequence
parallelism and sbh(34 + 5as/h)/t with it; "selective" recomputation of the attention core
leaves 34sbh/t and full recomputation keeps only the layer input, 2sbh (/t with SP). For a
Llama layer (SwiGLU of width f, RMSNorm, grouped-query attention with q/kv widths, flash
attention, no dropout) the same bookkeeping gives, with SP,

    sb[8h + 4q + 4kv + 6f]/t + 4sb*heads/t (the flash log-sum-exp, fp32),

which is 33.5sbh/t for Llama 3 70B. Under sequence parallelism Megatron stores the
column-parallel linears' inputs sharded and all-gathers them again for the weight gradient;
hyperloom's runtime stores the gathered input (`sharded_save=False`), which costs 2sbh per
linear input instead of 2sbh/t.

Recompute modules (`RECOMPUTE_MODULES`): ``core_attn`` (softmax/dropout intermediates, or the
flash log-sum-exp), ``mlp_act`` (the activation output that feeds the second MLP GEMM),
``norm`` (norm outputs that feed the first GEMM of each block); ``full`` keeps only the layer
input. Extending the planner to MoE or MLA means adding their GEMMs, all-to-all buffers and
saved tensors here; costs and memory follow.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperloom.config import ModelConfig
from hyperloom.planner.errors import PlanError

RECOMPUTE_MODULES = ("core_attn", "mlp_act", "norm")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a dense decoder-only transformer (Llama or GPT style)."""

    name: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    gated_mlp: bool = True  # SwiGLU (three matrices) or GeLU (two)
    norm: str = "rms"  # "rms" or "layer"
    bias: bool = False
    dropout: bool = False
    flash_attention: bool = True
    tie_embeddings: bool = False
    family: str = "llama"

    def __post_init__(self) -> None:
        if min(self.n_layers, self.dim, self.n_heads, self.n_kv_heads, self.ffn_dim) < 1:
            raise PlanError(f"model {self.name}: every size must be positive")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise PlanError(
                f"model {self.name}: dim ({self.dim}) must divide by heads ({self.n_heads}) "
                f"and heads by kv heads ({self.n_kv_heads})"
            )

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, name: str | None = None) -> ModelSpec:
        if cfg.family != "llama":
            raise PlanError(f"the planner models the llama family only, got {cfg.family!r}")
        return cls(
            name or cfg.preset,
            cfg.n_layers,
            cfg.dim,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.ffn_dim,
            cfg.vocab_size,
            tie_embeddings=cfg.tie_embeddings,
        )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def layer_matmul_params(self) -> int:
        attn = self.dim * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.dim
        return attn + self.mlp_matrices * self.dim * self.ffn_dim

    def layer_params(self) -> int:
        """Matrices, biases and norm weights of one layer."""
        n = self.layer_matmul_params() + (2 if self.norm == "rms" else 4) * self.dim
        if self.bias:
            n += self.q_dim + 2 * self.kv_dim + self.dim + (self.mlp_matrices - 1) * self.ffn_dim
            n += self.dim
        return n

    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    def params(self) -> int:
        head = 0 if self.tie_embeddings else self.embedding_params()
        return self.n_layers * self.layer_params() + self.embedding_params() + head + self.dim

    def matmul_params(self) -> int:
        """Weights in a matmul per token: every layer's linears plus the output head."""
        return self.n_layers * self.layer_matmul_params() + self.embedding_params()

    def model_flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token, Megatron/PaLM convention (full attention matrix): the
        same number as `hyperloom.models.llama.accounting.training_flops_per_token`."""
        return 6.0 * self.matmul_params() + 12.0 * self.n_layers * seq * self.q_dim


@dataclass(frozen=True)
class Gemm:
    """One forward GEMM on one rank: (m x k) @ (k x n), `count` times (batched heads)."""

    name: str
    m: float
    n: float
    k: float
    count: float = 1.0

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
    cp_buffer: float  # bytes of the full K+V gathered over cp
    grad_out_bytes: float  # output-gradient bytes of the GEMMs (Zero Bubble's W keeps them)

    @property
    def gemm_flops(self) -> float:
        return sum(g.flops for g in self.gemms)


def build_layer(
    spec: ModelSpec, mbs: int, seq: int, tp: int, cp: int, sp: bool, sharded_save: bool = True
) -> Layer:
    """The layer's work for `mbs` sequences of `seq` tokens split over cp and tp ranks."""
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
        core_saved = (Saved("softmax", 2 * scores, "core_attn"),)
        if spec.dropout:
            core_saved += (
                Saved("attn_dropout_mask", scores, "core_attn"),
                Saved("attn_dropout_out", 2 * scores, "core_attn"),
            )
    saved = [
        Saved("norm1_in", 2 * x_sp, "input"),
        Saved("qkv_in", 2 * x_in, "norm", gemm_input=True),
        Saved("q", 2 * tokens * q / t, "layer"),
        Saved("k", 2 * tokens * kv / t, "layer"),
        Saved("v", 2 * tokens * kv / t, "layer"),
        *core_saved,
        Saved("out_in", 2 * tokens * q / t, "layer", gemm_input=True),
        Saved("norm2_in", 2 * x_sp, "layer"),
        Saved("fc1_in", 2 * x_in, "norm", gemm_input=True),
        Saved("fc1_out", 2 * tokens * n_fc1 / t, "layer"),
        Saved("fc2_in", 2 * tokens * f / t, "mlp_act", gemm_input=True),
    ]
    if spec.dropout:
        saved += [Saved("attn_out_mask", x_sp, "layer"), Saved("mlp_out_mask", x_sp, "layer")]
    act = (6.0 if spec.gated_mlp else 4.0) * tokens * f / t
    elementwise = (
        2 * 4.0 * x_sp  # two norms: read + write
        + 4.0 * tokens * (q + kv) / t  # RoPE on q and k
        + 2 * 6.0 * x_sp  # two residual adds
        + act
        + (2 * 5.0 * x_sp if spec.dropout else 0.0)
    )
    grad_out = 2.0 * tokens * ((q + 2 * kv) / t + 2 * h + n_fc1 / t)
    return Layer(
        gemms=gemms,
        attn_flops=attn_flops,
        attn_gemms=attn_gemms,
        elementwise_bytes=elementwise,
        norm_bytes=2 * 4.0 * x_sp,
        act_bytes=act,
        core_bytes=core_bytes,
        saved=tuple(saved),
        tp_buffer=2.0 * x_full,
        cp_buffer=2.0 * 2.0 * tokens * cp * kv / t,
        grad_out_bytes=grad_out,
    )


def parse_recompute(policy: str) -> tuple[bool, frozenset[str]]:
    """'none' | 'selective' | 'full' | 'core_attn,mlp_act,...' -> (full, modules).

    'selective' recomputes the attention core and the MLP activation function: the cheap,
    memory-heavy pieces (Korthikanti's "selective" is 'core_attn' alone).
    """
    p = policy.strip().lower()
    if p in ("none", ""):
        return False, frozenset()
    if p == "full":
        return True, frozenset(RECOMPUTE_MODULES)
    if p == "selective":
        return False, frozenset({"core_attn", "mlp_act"})
    mods = frozenset(m.strip() for m in p.replace("+", ",").split(",") if m.strip())
    bad = sorted(mods - set(RECOMPUTE_MODULES))
    if bad:
        raise PlanError(
            f"unknown recompute module(s) {bad}; use none, selective, full or a list of "
            f"{', '.join(RECOMPUTE_MODULES)}"
        )
    return False, mods
