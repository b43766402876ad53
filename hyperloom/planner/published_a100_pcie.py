"""Measured step times of Megatron-LM runs on one node of 8 A100 PCIe, held out: SimuMax's
A100-PCIe set.

Moore Threads' SimuMax publishes, for 30 Megatron-LM runs on 8 A100 80GB PCIe (Llama 3 70B
cut to 12 layers and Llama 3 8B at tp 1 pp 2 / tp 2 / tp 4 / tp 8, DeepSeek-V2 cut to 4
layers at ep 8 and ep 4 pp 2; micro-batch 1, sequence 4,096, 4, 8 and 32 micro-batches, the
distributed optimizer), the relative error of its prediction of each run's throughput
(MooreThreads/SimuMax, docs/FULL_RESULTS.md "A100-PCIe" and assets/A100-Pcie.png, commit
4dcaae5 of May 2026): ``(predicted - measured) / measured`` TFLOP/s per GPU. A run's TFLOP/s
is its FLOPs over its step time, so its measured step time is SimuMax's predicted step time
times (1 + that error). SimuMax's predictions here are its own model's at that commit with
the repository's A100-PCIe system file and examples (``examples/perf_llama3_70b_layer12_*.py``
and the DeepSeek-V2 and Llama 3 8B ones: strategy files ``configs/strategy/*_mbs1.json``,
``configs/system/a100_pcie.json``), run for this table; its TFLOP/s at those predictions
agree with the figure's plotted estimates within about 1%, the uncertainty of the derived
times. No number of the planner was set from these rows.

Setup, as far as the repository states it: Megatron-Core with TransformerEngine, BF16, the
distributed optimizer (ZeRO-1), sequence parallelism at tp > 1, flash attention, no
recomputation, untied embeddings; DeepSeek-V2 with one leading dense layer, all-to-all
dispatch and capacity factor 1 with padding (every expert receives its share). Not stated
and assumed as in the B200 runs (`published_memory.SIMUMAX_RUNTIME`): no overlap of TP, p2p
or gradient-reduce communication; the unfused cross-entropy (the "_cef" fused runs are the
B200 set's).
"""

from __future__ import annotations

from dataclasses import replace

from hyperloom.planner.hardware import Cluster
from hyperloom.planner.published import Row, llama
from hyperloom.planner.published_memory import SIMUMAX_RUNTIME, simumax_model
from hyperloom.planner.simulate import Plan, predict
from hyperloom.planner.strategy import Runtime, Strategy

SOURCE = (
    "https://github.com/MooreThreads/SimuMax/blob/4dcaae513ba7679d56c116a17cd4a691ec41e252/"
    "docs/FULL_RESULTS.md"
)

# model, layers, tp, pp, ep; per micro-batch count: (SimuMax's predicted step ms, its
# published TFLOP/s error in percent)
SIMUMAX_A100_PCIE = [
    ("llama3-70b", 12, 1, 2, 1, {4: (4942.8, -1.46), 8: (7884.2, -0.10), 32: (25532.7, 2.12)}),
    ("llama3-70b", 12, 2, 1, 1, {4: (7231.6, -3.09), 8: (10728.1, -2.08), 32: (31707.2, 0.03)}),
    ("llama3-70b", 12, 4, 1, 1, {4: (4825.8, -0.59), 8: (7345.6, -1.28), 32: (22465.0, -1.71)}),
    ("llama3-70b", 12, 8, 1, 1, {4: (3003.0, -1.86), 8: (5940.3, -1.73), 32: (23564.5, -1.47)}),
    ("llama3-8b", 32, 1, 2, 1, {4: (3457.7, 0.04), 8: (5554.7, 1.53), 32: (18136.7, 3.76)}),
    ("llama3-8b", 32, 2, 1, 1, {4: (5534.2, -2.35), 8: (8632.1, -0.61), 32: (27219.8, -0.31)}),
    ("llama3-8b", 32, 4, 1, 1, {4: (4138.3, 1.96), 8: (6759.8, 1.35), 32: (22489.3, 2.08)}),
    ("llama3-8b", 32, 8, 1, 1, {4: (3572.2, -0.50), 8: (7101.7, -0.56), 32: (28278.8, -0.75)}),
    ("deepseek-v2", 4, 1, 1, 8, {4: (3718.3, -3.62), 8: (6260.2, -2.64), 32: (21511.8, -1.82)}),
    ("deepseek-v2", 4, 1, 2, 4, {4: (1693.6, -0.66), 8: (2855.0, -1.47), 32: (9823.7, -0.82)}),
]

# Megatron as assumed for these runs (module docstring): the B200 runs' runtime, unfused loss
A100_PCIE_RUNTIME: Runtime = replace(SIMUMAX_RUNTIME, ce_in_place=False)


def measured_ms(predicted_ms: float, tflops_error_pct: float) -> float:
    """A run's measured step time from SimuMax's prediction and its published throughput
    error ``(predicted - measured) / measured``: the step scales inversely with TFLOP/s."""
    return predicted_ms * (1.0 + tflops_error_pct / 100.0)


def a100_pcie_model(name: str, layers: int):
    """The runs' models: Llama 3 70B / DeepSeek-V2 as in the B200 set, Llama 3 8B whole."""
    if name == "llama3-8b":
        return llama(name, layers, 4096, 32, 8, 14336, 128256)
    return simumax_model(name, layers)


def a100_pcie_plan(row: tuple, microbatches: int, rt: Runtime | None = None) -> Plan:
    """The planner's prediction of one `SIMUMAX_A100_PCIE` layout (8 A100 PCIe, 1F1B)."""
    name, layers, tp, pp, ep = row[:5]
    s = Strategy(tp=tp, pp=pp, dp=8 // (tp * pp), ep=ep, zero=1, mbs=1, microbatches=microbatches)
    spec = a100_pcie_model(name, layers)
    return predict(spec, Cluster.of("a100-pcie", 8), s, 4096, rt or A100_PCIE_RUNTIME, fast=False)


def case_name(row: tuple, microbatches: int) -> str:
    name, layers, tp, pp, ep = row[:5]
    par = f"ep{ep} pp{pp}" if ep > 1 else f"tp{tp} pp{pp}"
    return f"{name} l{layers} {par} mbc {microbatches}"


def a100_pcie_step_time(rt: Runtime | None = None) -> list[Row]:
    """Measured (derived, module docstring) against predicted step time, seconds, per run."""
    out = []
    for row in SIMUMAX_A100_PCIE:
        for m, (pred, err) in row[5].items():
            plan = a100_pcie_plan(row, m, rt)
            out.append(Row("SimuMax A100 PCIe (Megatron-LM)", case_name(row, m), "step (s)",
                           measured_ms(pred, err) / 1000, plan.step_time))  # fmt: skip
    return out
