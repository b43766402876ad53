"""Published data points the planner is validated against, and the comparison itself.

Megatron-LM's H100 weak-scaling table (its README), Korthikanti et al. 2022 on A100 (arXiv
2205.05198 Table 5, Figure 1), Llama 3 405B on H100 (arXiv 2407.21783 Table 4) and
DeepSeek-V3 on H800 (arXiv 2412.19437, MFU derived from its GPU-hours), each as data. What
we had to assume for each (micro-batch, schedule, recompute, runtime, overlap) and the
resulting errors are in docs/planner.md, "Validation"; `python -m hyperloom.planner.published`
reproduces its tables.

Held out (never used to set a number of the planner; `held_out`): NVIDIA's published
Megatron-Core step throughputs on DGX-H100 and DGX-B200 (`NEMO_FP8`: the NeMo 24.07
performance summary, NVIDIA/NeMo docs/source/performance/performance_summary.md, and the
Megatron-Bridge 25.11 one, NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md), and
torchtitan's FSDP2 runs on 64 A100s (`TORCHTITAN_A100`, pytorch/torchtitan
docs/performance.md as of April 2024); measured peak memory and step times of Megatron-LM
runs on 8 B200s are in `published_memory`. Each row's published tokens/s per GPU becomes a step
time, ``global batch x sequence / (tokens/s/GPU x GPUs)``, and the planner predicts that
step for the published layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hyperloom.config import ModelConfig
from hyperloom.planner.hardware import GIB, Cluster
from hyperloom.planner.memory import Memory
from hyperloom.planner.model import ModelSpec
from hyperloom.planner.simulate import Plan, memory_per_rank, predict, prepare, with_roofline
from hyperloom.planner.strategy import RUNTIMES, Strategy


def gpt(
    name: str, heads: int, hidden: int, layers: int, vocab: int, tie_embeddings: bool = False, **kw
) -> ModelSpec:
    """A GPT of the published runs: LayerNorm, a GeLU MLP of 4h, biases; `kw` are the
    `ModelSpec` facts beyond the config (dropout, flash attention)."""
    shape = ModelConfig(
        preset=name,
        n_layers=layers,
        dim=hidden,
        n_heads=heads,
        n_kv_heads=heads,
        ffn_dim=4 * hidden,
        vocab_size=vocab,
        tie_embeddings=tie_embeddings,
    )
    return ModelSpec(shape, gated_mlp=False, norm="layer", bias=True, **kw)


# name, heads, hidden, layers, tp, pp, dp, global batch, published TFLOP/s per GPU
MEGATRON_H100 = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 3072, 459.9),
]

# name, heads, hidden, layers, pp, gpus, global batch, mbs, vpp,
# time full-recompute, time sp+selective (s), memory states | acts none -> sp+selective (GiB)
KORTHIKANTI_A100 = [
    ("22B", 64, 6144, 48, 1, 8, 4, 4, 1, 1.42, 1.10, 45.56, 59.25, 9.56),
    ("175B", 96, 12288, 96, 8, 64, 64, 1, 3, 18.13, 13.75, 45.56, 66.84, 12.35),
    ("530B", 128, 20480, 105, 35, 280, 280, 1, 3, 49.05, 37.83, 31.64, 114.0, 23.08),
    ("1T", 160, 25600, 128, 64, 512, 512, 1, 1, 94.42, 71.49, 32.96, 131.25, 26.56),
]

# gpus, tp, cp, pp, dp, seq, published MFU
LLAMA3_405B = [
    (8192, 8, 1, 16, 64, 8192, 0.43),
    (16384, 8, 1, 16, 128, 8192, 0.41),
    (16384, 8, 16, 16, 8, 131072, 0.38),
]
LLAMA3_405B_SPEC = ModelSpec(
    ModelConfig(
        preset="llama3-405b",
        n_layers=126,
        dim=16384,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        vocab_size=128256,
    )
)
LLAMA3_TOKENS_PER_BATCH = 16 * 1024 * 1024


def llama(name: str, layers: int, dim: int, heads: int, kv: int, ffn: int, vocab: int):
    """A Llama-family model of a published run (RMSNorm, SwiGLU, RoPE, no biases)."""
    shape = ModelConfig(
        preset=name,
        n_layers=layers,
        dim=dim,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=ffn,
        vocab_size=vocab,
    )
    return ModelSpec(shape)


# The held-out runs' models: Llama 2 (arXiv 2307.09288) and Llama 3 (arXiv 2407.21783)
# shapes; NeMo's GPT-3 recipes (LayerNorm, GeLU 4h, biases; vocabulary 51,200 assumed, the
# GPT-2 BPE padded as Megatron pads it; 5B: 24 x 4096 x 32 heads, 20B: 44 x 6144 x 48,
# 175B: 96 x 12288 x 96, NeMo-Framework-Launcher conf/training/gpt3).
HELD_OUT_MODELS = {
    "gpt3-5b": lambda: gpt("gpt3-5b", 32, 4096, 24, 51200),
    "gpt3-20b": lambda: gpt("gpt3-20b", 48, 6144, 44, 51200),
    "gpt3-175b": lambda: gpt("gpt3-175b", 96, 12288, 96, 51200),
    "llama2-7b": lambda: llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000),
    "llama2-13b": lambda: llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000),
    "llama2-70b": lambda: llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000),
    "llama3-8b": lambda: llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": lambda: llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama3.1-405b": lambda: LLAMA3_405B_SPEC,
}

# source, system, model, GPUs, global batch, micro-batch, sequence, tp, pp, cp, vp,
# published tokens/s per GPU. All FP8 (TransformerEngine), distributed optimizer, no
# activation recomputation (the launcher's configs of the time: activations_checkpoint_*
# null), sequence parallelism with tp > 1.
NEMO_FP8 = [
    ("NeMo 24.07", "h100", "gpt3-5b", 64, 2048, 4, 2048, 1, 1, 1, 1, 22521),
    ("NeMo 24.07", "h100", "gpt3-20b", 64, 256, 2, 2048, 2, 1, 1, 1, 5851),
    ("NeMo 24.07", "h100", "gpt3-175b", 128, 256, 1, 2048, 4, 8, 1, 6, 726),
    ("NeMo 24.07", "h100", "gpt3-175b", 512, 2048, 2, 2048, 4, 8, 1, 6, 782),
    ("NeMo 24.07", "h100", "llama2-7b", 8, 128, 1, 4096, 1, 1, 1, 1, 16847),
    ("NeMo 24.07", "h100", "llama2-13b", 16, 128, 1, 4096, 1, 4, 1, 10, 8646),
    ("NeMo 24.07", "h100", "llama2-70b", 64, 128, 1, 4096, 4, 4, 1, 20, 1707),
    ("NeMo 24.07", "h100", "llama3-8b", 8, 128, 1, 8192, 1, 1, 2, 1, 12036),
    ("NeMo 24.07", "h100", "llama3-70b", 64, 128, 1, 8192, 4, 4, 2, 5, 1533),
    ("Megatron-Bridge 25.11", "b200", "llama3-8b", 8, 128, 2, 8192, 1, 1, 1, 1, 30624),
    ("Megatron-Bridge 25.11", "b200", "llama3.1-405b", 128, 64, 1, 8192, 4, 8, 2, 8, 661),
    ("Megatron-Bridge 25.11", "h100", "llama3-70b", 64, 128, 1, 8192, 4, 8, 1, 5, 1602),
    ("Megatron-Bridge 25.11", "h100", "llama3.1-405b", 1024, 512, 1, 8192, 8, 8, 2, 8, 292),
]

# model, global batch per GPU, sequence, activation checkpointing, norm kind, tokens/s per
# GPU; 64 A100 80GB (8 nodes), FSDP2 only (BF16 gathers, FP32 reduce-scatter), eager
# PyTorch (compile off). The rows with torchtitan's selective op or layer checkpointing are
# left out: their recompute has no planner policy (every other matmul, every other layer).
TORCHTITAN_A100 = [
    ("llama3-70b", 1, 8192, "full", "rmsnorm", 331),
    ("llama2-13b", 2, 4096, "none", "fused_rmsnorm", 2162),
    ("llama2-70b", 2, 4096, "full", "rmsnorm", 353),
]


@dataclass(frozen=True)
class Row:
    """One predicted-vs-published comparison."""

    source: str
    case: str
    quantity: str
    published: float
    predicted: float
    note: str = ""

    @property
    def error(self) -> float:
        """Relative error of the prediction, (predicted - published) / published."""
        return (self.predicted - self.published) / self.published


def megatron_h100(
    runtime_overrides: dict | None = None, fast: bool = False
) -> list[tuple[Row, Plan]]:
    rt = replace(RUNTIMES["megatron"], **(runtime_overrides or {}))
    out = []
    for name, heads, hidden, layers, tp, pp, dp, gbs, tflops in MEGATRON_H100:
        spec = gpt(f"gpt-{name}", heads, hidden, layers, 131072)
        s = Strategy(tp=tp, pp=pp, dp=dp, zero=1, mbs=1, microbatches=gbs // dp)
        plan = predict(spec, Cluster.of("h100", tp * pp * dp), s, 4096, rt, fast=fast)
        pub = tflops / 989.4
        out.append((Row("Megatron-LM H100", name, "MFU", pub, plan.mfu, s.label()), plan))
    return out


def korthikanti_a100(
    fast: bool = False, models: tuple[str, ...] | None = None
) -> list[tuple[Row, Plan | Memory]]:
    """Iteration time (both recompute modes) and Figure 1 memory, per model (all, or
    `models`). The no-recompute layout is sized, not timed (the paper does not time it)."""
    rt = replace(RUNTIMES["megatron"], tp_overlap=0.0, zero1_overlap=0.0)
    out: list[tuple[Row, Plan | Memory]] = []
    for row in KORTHIKANTI_A100:
        name, heads, hidden, layers, pp, gpus, gbs, mbs, vpp = row[:9]
        if models is not None and name not in models:
            continue
        t_full, t_sel, states, act_none, act_sel = row[9:]
        spec = gpt(
            f"gpt-{name}",
            heads,
            hidden,
            layers,
            51200,
            dropout=True,
            flash_attention=False,
            tie_embeddings=True,
        )
        cl = Cluster.of("a100", gpus)
        kind = "interleaved" if vpp > 1 else "1f1b"
        base = Strategy(tp=8, pp=pp, dp=1, mbs=mbs, microbatches=gbs // mbs, schedule=kind, vpp=vpp)
        full = predict(spec, cl, replace(base, sp=False, recompute="full"), 2048, rt, fast=fast)
        sel = predict(spec, cl, replace(base, sp=True, recompute="core_attn"), 2048, rt, fast=fast)
        none_s = replace(base, sp=False, recompute="none")
        m_none = memory_per_rank(spec, none_s, 2048, rt, prepare(spec, cl, none_s, 2048, rt))[0]
        src = "Korthikanti 2022 A100"
        out.append((Row(src, name, "time full recompute (s)", t_full, full.step_time), full))
        out.append((Row(src, name, "time SP+selective (s)", t_sel, sel.step_time), sel))
        m_sel = sel.memory[0]
        out.append(
            (
                Row(
                    src,
                    name,
                    "params+optimizer (GiB)",
                    states,
                    m_sel.states / GIB,
                    "stage 0, embedding included",
                ),
                sel,
            )
        )
        out.append(
            (
                Row(
                    src,
                    name,
                    "activations, none (GiB)",
                    act_none,
                    m_none.activations / GIB,
                    "TP without SP",
                ),
                m_none,
            )
        )
        out.append(
            (
                Row(src, name, "activations, SP+selective (GiB)", act_sel, m_sel.activations / GIB),
                sel,
            )
        )
    return out


LLAMA3_FITTING = ("none", "selective", "core_attn,mlp_act,norm", "full")


def llama3_405b(
    runtime_overrides: dict | None = None,
    fast: bool = False,
    policies: tuple[str, ...] = ("none",),
) -> list[tuple[Row, Plan]]:
    """The three Table 4 rows under one recompute policy: the first of `policies` that fits
    all three in 80 GB by our memory model, else the last. By default no recomputation (the
    report's §3.3.2: pipeline buffers freed early instead of activation checkpointing), memory
    not checked; `LLAMA3_FITTING` picks the lightest that our memory model fits (full)."""
    rt = replace(RUNTIMES["megatron"], **(runtime_overrides or {}))
    plans: list[Plan] = []
    for rc in policies:
        plans = []
        for gpus, tp, cp, pp, dp, seq, _ in LLAMA3_405B:
            seqs = LLAMA3_TOKENS_PER_BATCH // seq
            s = Strategy(
                tp=tp,
                cp=cp,
                pp=pp,
                dp=dp,
                zero=1,
                mbs=1,
                microbatches=seqs // dp,
                schedule="interleaved",
                vpp=2,
                recompute=rc,
            )
            plans.append(predict(LLAMA3_405B_SPEC, Cluster.of("h100", gpus), s, seq, rt, fast=fast))
        if all(p.fits for p in plans):
            break
    out = []
    for (gpus, tp, cp, pp, dp, seq, mfu), plan in zip(LLAMA3_405B, plans, strict=True):
        case = f"{gpus} GPUs {tp}/{cp}/{pp}/{dp} seq {seq}"
        note = plan.strategy.label() + ("" if plan.fits else " (does not fit)")
        out.append((Row("Llama 3 405B", case, "MFU", mfu, plan.mfu, note), plan))
    return out


DEEPSEEK_V3_MFU = 14.8e12 * 291_847_274_496 / (2.788e6 * 3600 * 989.4e12)  # 0.435


# DeepSeek-V3's layout (docs/planner.md, Validation 5) and the runtimes its all-to-all is costed under.
DEEPSEEK_V3_LAYOUT = Strategy(
    ep_overlap=True,  # DualPipe's pairs; the runtimes below say how much they hide
    tp=1,
    pp=16,
    dp=128,
    ep=64,
    zero=1,
    mbs=1,
    microbatches=120,
    schedule="dualpipe",
    recompute="norm,mlp_act",
    fp8=True,
)
DEEPSEEK_V3_RUNTIMES = {
    "plain all-to-all": {},
    "DeepSeek dispatch": {"a2a_node_dedup": True, "fp8_dispatch": True},
    "DeepSeek dispatch, DualPipe overlap": {
        "a2a_node_dedup": True,
        "fp8_dispatch": True,
        "ep_pair_hidden": 1.0,
    },
}


def deepseek_v3_spec(imbalance: float | None = None) -> ModelSpec:
    from hyperloom.config import preset_config

    spec = ModelSpec.from_model_config(preset_config("deepseek-v3"), "deepseek-v3")
    return spec if imbalance is None else replace(spec, moe_imbalance=imbalance)


def h800_cluster(gpus: int = 2048) -> Cluster:
    """The h100 profile with H800's NVLink: 400 GB/s both ways, 200 one way."""
    cluster = Cluster.of("h100", gpus)
    return replace(cluster, profile=replace(cluster.profile, intra_gbs=200.0))


def deepseek_v3(
    fast: bool = True,
    runtime_overrides: dict | None = None,
    imbalance: float | None = None,
    with_ep1: bool = True,
) -> list[tuple[Row, Plan]]:
    """DeepSeek-V3's derived MFU against its own layout under the three all-to-all
    descriptions of `DEEPSEEK_V3_RUNTIMES`, and (`with_ep1`) the closest layout without
    expert parallelism (docstring item 4)."""
    spec, cluster = deepseek_v3_spec(imbalance), h800_cluster()
    out = []
    if with_ep1:
        s = Strategy(tp=8, pp=16, dp=16, zero=1, mbs=1, microbatches=960, recompute="full")
        plan = predict(spec, cluster, s, 4096, "megatron", fast=fast)
        note = plan.strategy.label() + ("" if plan.fits else " (does not fit)")
        row = Row("DeepSeek-V3", "ep 1, tp 8 (no EP)", "MFU", DEEPSEEK_V3_MFU, plan.mfu, note)
        out.append((row, plan))
    for name, extra in DEEPSEEK_V3_RUNTIMES.items():
        rt = replace(RUNTIMES["megatron"], **{**extra, **(runtime_overrides or {})})
        plan = predict(spec, cluster, DEEPSEEK_V3_LAYOUT, 4096, rt, fast=fast)
        note = plan.strategy.label()
        if not plan.fits:
            note += f" (does not fit: {plan.reserved_memory / GIB:.0f} GiB reserved)"
        row = Row("DeepSeek-V3", f"ep 64, {name}", "MFU", DEEPSEEK_V3_MFU, plan.mfu, note)
        out.append((row, plan))
    return out


def nemo_fp8(fast: bool = True) -> list[tuple[Row, Plan]]:
    """NVIDIA's Megatron-Core runs (`NEMO_FP8`): the published layout, FP8, no recompute, the
    megatron runtime (its TP overlap, distributed optimizer); memory is not checked (our
    memory model, which keeps every saved tensor of every in-flight micro-batch, puts most of
    them over 80 GiB, though they ran)."""
    out = []
    for src, acc, name, gpus, gbs, mbs, seq, tp, pp, cp, vp, tps in NEMO_FP8:
        dp = gpus // (tp * pp * cp)
        s = Strategy(
            tp=tp,
            pp=pp,
            cp=cp,
            dp=dp,
            zero=1,
            mbs=mbs,
            microbatches=gbs // (dp * mbs),
            schedule="interleaved" if vp > 1 else "1f1b",
            vpp=vp,
            fp8=True,
        )
        plan = predict(
            HELD_OUT_MODELS[name](), Cluster.of(acc, gpus), s, seq, "megatron", fast=fast
        )
        case = f"{acc} {name} {gpus} GPUs {s.label()}"
        step = gbs * seq / (tps * gpus)
        out.append((Row(src, case, "step (s)", step, plan.step_time), plan))
    return out


def eager_elementwise_factor(spec: ModelSpec, fused_norm: bool) -> float:
    """Bytes an eager PyTorch Llama layer's elementwise ops move (torchtitan of April 2024,
    compile off) over what `model.build_layer` charges its fused kernels, per token forward:
    RMSNorm as upcast, square, mean, scale, downcast, weight (2+4, 4+4, 4, 4+4, 4+2, 2+2 =
    36 B per element, or 4 B when ``fused_rmsnorm``), RoPE through complex numbers (upcast,
    multiply, downcast: 20 B per q and k element), the attention output made contiguous
    (4 B per q element) and, with grouped queries, K and V repeated to every head (4 B), SiLU
    then the product (10 B per FFN element), the two residual adds (12 B per model element);
    against 8 + 12 per model element, 4 per q and k element and 6 per FFN element fused."""
    h, q, kv, f = spec.dim, spec.q_dim, spec.kv_dim, spec.ffn_dim
    fused = 20 * h + 4 * (q + kv) + 6 * f
    repeat = 4 * q if spec.n_kv_heads < spec.n_heads else 0
    eager = (8 if fused_norm else 72) * h + 20 * (q + kv) + 4 * q + repeat + 10 * f + 12 * h
    return eager / fused


# torchtitan's FSDP2 as the planner costs it: FP32 parameters sharded, gathered in BF16
# (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), no autocast weight copies.
TORCHTITAN_RUNTIME = replace(
    RUNTIMES["hyperloom"], param_gather_bytes=2, autocast_weight_copy=False
)


def torchtitan_a100(fast: bool = True, eager: bool = True) -> list[tuple[Row, Plan]]:
    """torchtitan's FSDP2 runs on 64 A100s (`TORCHTITAN_A100`), ZeRO-3 over all 64 ranks,
    one micro-batch of the local batch; `eager`: the layer's elementwise ops at their eager
    bytes (`eager_elementwise_factor`, as a slower elementwise rate)."""
    out = []
    for name, bs, seq, rc, norm, tps in TORCHTITAN_A100:
        spec = HELD_OUT_MODELS[name]()
        acc = Cluster.of("a100", 64).profile
        if eager:
            factor = eager_elementwise_factor(spec, norm == "fused_rmsnorm")
            acc = replace(acc, elementwise_eff=acc.elementwise_eff / factor)
        s = Strategy(dp=64, zero=3, mbs=bs, microbatches=1, recompute=rc)
        plan = predict(spec, Cluster(acc, 64, 8), s, seq, TORCHTITAN_RUNTIME, fast=fast)
        step = bs * seq / tps
        note = f"rc:{rc}" + (" eager" if eager else "")
        out.append((Row("torchtitan A100", f"{name} bs{bs} x {seq}", "step (s)", step,
                        plan.step_time, note), plan))  # fmt: skip
    return out


def held_out(fast: bool = True) -> list[tuple[Row, Plan]]:
    """Every held-out row (module docstring)."""
    return nemo_fp8(fast) + torchtitan_a100(fast)


# Rows the efficiency factor is fitted on; the others are held out.
FIT_ROWS = ("1.7B", "16B", "70B", "177B", "462B")


def fit_efficiency(
    rows: tuple[str, ...] = FIT_ROWS, lo: float = 0.5, hi: float = 1.5, fast: bool = False
) -> float:
    """The `Runtime.efficiency` that minimises the squared log error of the predicted MFU on
    the Megatron H100 `rows` (golden-section search; the error is unimodal in it), on top
    of the h100 profile's ``step_eff``, which is this fit made once (`profiles.py`): about
    1 while the kernel model stands as it was fitted."""

    def loss(eff: float) -> float:
        pairs = megatron_h100({"efficiency": eff}, fast=fast)
        return sum(math.log(r.predicted / r.published) ** 2 for r, _ in pairs if r.case in rows)

    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    for _ in range(25):
        if loss(c) < loss(d):
            b = d
        else:
            a = c
        c, d = b - g * (b - a), a + g * (b - a)
    return round((a + b) / 2, 3)


def _table(rows: list[Row], extra: str = "") -> str:
    head = (
        f"| case | quantity | published | predicted | error |{' ' + extra + ' |' if extra else ''}"
    )
    sep = "|---|---|---:|---:|---:|" + ("---|" if extra else "")
    lines = [head, sep]
    for r in rows:
        tail = f" {r.note} |" if extra else ""
        lines.append(
            f"| {r.case} | {r.quantity} | {r.published:.4g} | {r.predicted:.4g} | "
            f"{r.error:+.1%} |{tail}"
        )
    errs = [abs(r.error) for r in rows]
    lines.append(f"\nmean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%}")
    return "\n".join(lines)


def report_markdown() -> str:
    """The validation tables of docs/planner.md, recomputed."""
    out = []
    prior = megatron_h100()
    eff = fit_efficiency()
    out.append("### Megatron-LM H100, the h100 profile (its step_eff fitted on these rows)\n")
    out.append(_table([r for r, _ in prior], "layout"))
    out.append(f"\nfit rows {', '.join(FIT_ROWS)}; a further efficiency refitted on them: {eff}\n")
    out.append("\n### Megatron-LM H100, the roofline (every efficiency 1)\n")
    bounds = [replace(r, predicted=with_roofline(p).roofline_mfu) for r, p in prior]
    out.append(_table(bounds))
    out.append("\n### Korthikanti et al. 2022, A100, a priori\n")
    out.append(_table([r for r, _ in korthikanti_a100()], "note"))
    out.append("\n### Llama 3 405B, H100, no recomputation (memory not checked)\n")
    out.append(_table([r for r, _ in llama3_405b()], "plan"))
    out.append("\n### Llama 3 405B, H100, the lightest recompute our memory model fits\n")
    out.append(_table([r for r, _ in llama3_405b(policies=LLAMA3_FITTING)], "plan"))
    out.append("\n### DeepSeek-V3, H800 (h100 profile, 200 GB/s NVLink)\n")
    out.append(_table([r for r, _ in deepseek_v3()], "plan"))
    for imb in (1.0, 1.5):
        out.append(f"\n### DeepSeek-V3, a priori, moe_imbalance {imb}\n")
        rows = deepseek_v3(imbalance=imb, with_ep1=False)
        out.append(_table([r for r, _ in rows], "plan"))
    out.append("\n### Held out: NVIDIA Megatron-Core FP8 runs, H100 and B200\n")
    out.append(_table([r for r, _ in nemo_fp8(fast=False)]))
    out.append("\n### Held out: torchtitan FSDP2 on 64 A100s, eager elementwise bytes\n")
    out.append(_table([r for r, _ in torchtitan_a100(fast=False)], "note"))
    out.append("\n### Held out: torchtitan, the layer's fused bytes\n")
    out.append(_table([r for r, _ in torchtitan_a100(fast=False, eager=False)], "note"))
    from hyperloom.planner import published_memory as pm  # it builds on this module

    out.append("\n### Held out: Megatron-LM on 8 B200s (SimuMax's runs), step time\n")
    out.append(_table(pm.simumax_step_time()))
    out.append("\n### Held out: the same runs, peak memory allocated and reserved (GiB)\n")
    out.append(_table(pm.simumax_memory()))
    from hyperloom.planner import published_a100_pcie as pa

    out.append("\n### Held out: Megatron-LM on 8 A100 PCIe (SimuMax's runs), step time\n")
    out.append(_table(pa.a100_pcie_step_time()))
    return "\n".join(out)


if __name__ == "__main__":  # python -m hyperloom.planner.published
    print(report_markdown())
