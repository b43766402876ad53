"""Measured peak memory (and step time) of real GPU runs, held out: SimuMax's B200 release set.

Moore Threads' SimuMax publishes, beside its own predictions, the measured peak memory and
step time of Megatron-LM training runs on one node of 8 B200s (MooreThreads/SimuMax,
docs/b200/b200_release_v1.2_summary.md and its .json, commit 4dcaae5 of May 2026): Llama 3 70B
(12 layers) and 405B (4 layers), DeepSeek-V2 and -V3 (4 layers, the first dense) at tp / pp /
ep / cp layouts, 4 to 32 micro-batches. Measured per rank with Megatron's memory report
(`torch.cuda.max_memory_allocated` and `max_memory_reserved`, all ranks, after the warm-up
iterations); the table gives the largest rank's, which is what `predict` calls a plan's peak
(`Memory.peak`, allocated) and reserved (`Memory.reserved`). The runs' memory does not
depend on the micro-batch count (1F1B at pp <= 2), so one row per layout is kept.

The runs' setup, from the repository's launchers (tools/b200/run_megatron_perf_real_*.py,
simu_tools/megatron_scripts/scripts/run_pretrain_{llama3,deepseekv2}.sh, docs/strategy.md):
Megatron-Core with TransformerEngine 2.11, BF16, the distributed optimizer (FP32 main
gradients, `--accumulate-allreduce-grads-in-fp32`), flash attention, sequence parallelism,
no recomputation (`--recompute-num-layers 0`), untied embeddings, micro-batch 1, sequence
4,096 (32K / 128K with cp, `--cp-comm-type a2a`: Ulysses), TE's fused cross-entropy
(`--cross-entropy-loss-fusion --cross-entropy-fusion-impl te`, the "_cef" cases), no TP,
p2p or gradient-reduce overlap; Llama 3 405B with 16 query groups (their script's value);
MoE: all-to-all dispatch, grouped GEMM, capacity factor 1 with padding to capacity (every
expert receives exactly its share: `moe_imbalance` 1), no MTP. No number of the planner was
set from these rows: they were found after its memory model, and what changed because of
them is each a documented behaviour of that setup (`Runtime.ce_in_place`,
`Runtime.te_dummy_wgrad`, `ModelSpec.chunk_layer_params`).
"""

from __future__ import annotations

from dataclasses import replace

from hyperloom.config import preset_config
from hyperloom.planner.hardware import GIB, Cluster
from hyperloom.planner.model import ModelSpec
from hyperloom.planner.published import Row, llama
from hyperloom.planner.simulate import Plan, predict
from hyperloom.planner.strategy import RUNTIMES, Runtime, Strategy

SIMUMAX_SOURCE = (
    "https://github.com/MooreThreads/SimuMax/blob/4dcaae513ba7679d56c116a17cd4a691ec41e252/"
    "docs/b200/b200_release_v1.2_summary.json"
)

# model, layers, tp, pp, cp, ep, sequence, measured max allocated / reserved GiB (largest
# rank), measured step ms by micro-batch count
SIMUMAX_B200 = [
    ("llama3-70b", 12, 1, 2, 1, 1, 4096, 66.55, 70.88, {4: 843.0, 8: 1476.8, 32: 5436.5}),
    ("llama3-70b", 12, 2, 1, 1, 1, 4096, 60.68, 62.53, {4: 725.5, 8: 1387.0, 32: 5376.5}),
    ("llama3-70b", 12, 4, 1, 1, 1, 4096, 39.07, 40.18, {4: 409.8, 8: 765.6, 32: 2964.6}),
    ("llama3-70b", 12, 8, 1, 1, 1, 4096, 28.29, 29.12, {4: 280.9, 8: 556.7, 32: 2073.7}),
    ("llama3-405b", 4, 1, 2, 1, 1, 4096, 87.08, 92.26, {4: 1074.6, 8: 1935.4, 32: 7046.4}),
    ("llama3-405b", 4, 2, 1, 1, 1, 4096, 81.59, 84.70, {4: 907.3, 8: 1716.8, 32: 6604.1}),
    ("llama3-405b", 4, 4, 1, 1, 1, 4096, 52.89, 54.65, {4: 476.0, 8: 899.6, 32: 3455.4}),
    ("llama3-405b", 4, 8, 1, 1, 1, 4096, 38.57, 39.83, {4: 258.8, 8: 488.1, 32: 1901.8}),
    ("deepseek-v2", 4, 1, 1, 1, 8, 4096, 45.63, 48.79, {4: 366.6, 8: 676.2, 32: 2721.3}),
    ("deepseek-v2", 4, 1, 2, 1, 4, 4096, 44.70, 47.05, {4: 282.1, 8: 492.6, 32: 1727.7}),
    ("deepseek-v3", 4, 1, 1, 1, 8, 4096, 104.30, 110.18, {4: 603.2, 8: 1101.7, 32: 4141.2}),
    ("deepseek-v3", 4, 1, 2, 1, 4, 4096, 114.00, 118.61, {4: 452.2, 8: 771.6, 32: 2718.6}),
    ("llama3-70b", 12, 2, 1, 4, 1, 32768, 68.43, 70.33, {4: 1758.0}),
    ("llama3-70b", 12, 1, 1, 8, 1, 32768, 104.51, 111.94, {4: 1768.1}),
    ("llama3-405b", 4, 2, 1, 4, 1, 32768, 87.03, 91.15, {4: 1984.7}),
    ("llama3-405b", 4, 1, 1, 8, 1, 32768, 139.22, 152.14, {4: 2003.6}),
    ("llama3-70b", 12, 2, 1, 4, 1, 131072, 112.67, 121.40, {4: 11315.7}),
    ("llama3-70b", 12, 1, 1, 8, 1, 131072, 147.99, 159.65, {4: 11301.9}),
    ("llama3-405b", 4, 2, 1, 4, 1, 131072, 118.13, 127.50, {4: 10577.6}),
]

# Megatron as these runs were launched: the megatron runtime with TE's fused cross-entropy
# and every overlap off (their launcher's --disable-tp-comm-overlap-*, no --overlap-grad-reduce)
SIMUMAX_RUNTIME: Runtime = replace(
    RUNTIMES["megatron"], ce_in_place=True, tp_overlap=0.0, zero1_overlap=0.0
)


def simumax_model(name: str, layers: int) -> ModelSpec:
    """The runs' models, cut to `layers`: Llama 3 70B, 405B (16 query groups, as launched),
    DeepSeek-V2 and -V3 with one leading dense layer and no MTP (their Megatron arguments)."""
    if name == "llama3-70b":
        return llama(name, layers, 8192, 64, 8, 28672, 128256)
    if name == "llama3-405b":
        return llama(name, layers, 16384, 128, 16, 53248, 128256)
    cfg = preset_config("deepseek-v3")
    if name == "deepseek-v2":
        cfg = replace(cfg, vocab_size=102400, dim=5120, ffn_dim=12288, n_routed_experts=160,
                      n_shared_experts=2, moe_top_k=6, moe_ffn_dim=1536)  # fmt: skip
    cfg = replace(cfg, n_layers=layers, n_dense_layers=1, mtp_depth=0, moe_n_groups=1,
                  moe_topk_groups=1)  # fmt: skip
    return replace(ModelSpec.from_model_config(cfg, name), moe_imbalance=1.0)


def simumax_plan(row: tuple, microbatches: int = 4, rt: Runtime | None = None) -> Plan:
    """The planner's prediction of one `SIMUMAX_B200` layout (8 B200s, 1F1B)."""
    name, layers, tp, pp, cp, ep, seq = row[:7]
    dp = 8 // (tp * pp * cp)
    s = Strategy(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, zero=1, mbs=1, microbatches=microbatches,
                 cp_comm="alltoall")  # fmt: skip
    return predict(simumax_model(name, layers), Cluster.of("b200", 8), s, seq,
                   rt or SIMUMAX_RUNTIME, fast=False)  # fmt: skip


def case_name(row: tuple) -> str:
    name, layers, tp, pp, cp, ep, seq = row[:7]
    parts = [f"{name} l{layers} tp{tp} pp{pp}"] + [f"cp{cp}"] * (cp > 1) + [f"ep{ep}"] * (ep > 1)
    return " ".join(parts) + f" seq {seq}"


def simumax_memory(rt: Runtime | None = None) -> list[Row]:
    """Measured against predicted peak memory, GiB, of every layout: allocated (the plan's
    peak over its pipeline ranks) and reserved (`Memory.reserved`, peak / 0.94)."""
    out = []
    for row in SIMUMAX_B200:
        plan = simumax_plan(row, rt=rt)
        src, case, note = "SimuMax B200 (Megatron-LM)", case_name(row), plan.strategy.label()
        out.append(Row(src, case, "allocated (GiB)", row[7], plan.peak_memory / GIB, note))
        out.append(Row(src, case, "reserved (GiB)", row[8], plan.reserved_memory / GIB, note))
    return out


def simumax_step_time(rt: Runtime | None = None) -> list[Row]:
    """Measured against predicted step time, seconds, of every layout and micro-batch count."""
    out = []
    for row in SIMUMAX_B200:
        for m, ms in row[9].items():
            plan = simumax_plan(row, m, rt)
            out.append(Row("SimuMax B200 (Megatron-LM)", f"{case_name(row)} mbc {m}",
                           "step (s)", ms / 1000, plan.step_time))  # fmt: skip
    return out
