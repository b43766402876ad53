"""GEMM micro-benchmark: FP32, BF16 and FP8 per scaling recipe, out = A Bᵀ (M, K) x (N, K).

For each shape and contender: the GEMM alone on operands quantized beforehand (what a kernel
costs), quantize + GEMM (what a training step pays: per-tensor recipes one amax pass, block
recipes a blocked amax, all a cast), and the relative error of the result against an FP64
product of the unquantized operands. Output BF16, as a training step asks. On a GPU the
per-tensor and rowwise GEMMs go through `torch._scaled_mm`; on a CPU every FP8 GEMM is
emulated (`hyperloom.engine.fp8.gemm`): operands dequantized, then one GEMM -- in BF16 for
power-of-two scales (rowwise, blockwise 1x128 / 128x128, MXFP8 1x32 E8M0; exact there), in
FP32 for the others (current, delayed) -- so the times say what the emulation costs here,
not what FP8 hardware would do. The delayed recipe casts with a stored scale; its GEMM is
the per-tensor one.

Each timing is the median of `--repeats` runs after one warm-up, bracketed by a device
synchronize; the CPU time other processes took meanwhile is recorded (`machine.cpu_seconds`)
so a contended measurement is visible in the JSON.

    python benchmarks/fp8_gemm.py                          # the default shapes, this machine
    python benchmarks/fp8_gemm.py --shapes 4096x4096x4096 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import machine  # benchmarks/ is on sys.path (scripts run from there)
import torch

from hyperloom.accelerator import get_accelerator
from hyperloom.engine.fp8 import fp8_gemm, quantize_for, recipe_from_name
from hyperloom.engine.fp8.recipes import DelayedState

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "fp8_gemm.json"
DEFAULT_SHAPES = "256x256x256,512x512x2048,1024x1024x1024"
FP8_RECIPES = ("delayed", "current", "rowwise", "blockwise", "mxfp8")


def _timed(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> dict[str, float]:
    fn()  # warm-up
    sync()
    times, others = [], []
    for _ in range(repeats):
        c0, t0 = machine.cpu_seconds(), time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t0
        c1 = machine.cpu_seconds()
        times.append(dt)
        if c0 and c1:
            others.append(((c1[0] - c0[0]) - (c1[1] - c0[1])) / dt)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "other_cores": statistics.mean(others) if others else None,
    }


def _rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm()).item()


def bench_shape(m: int, n: int, k: int, device: torch.device, sync, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device)
    b = (torch.randn(n, k, generator=gen) * 0.02).to(device)
    exact = a.double() @ b.double().t()
    flops = 2 * m * n * k
    rows = []

    def row(name: str, gemm, full=None, out=None) -> None:
        t = _timed(gemm, sync, repeats)
        r = {"shape": [m, n, k], "contender": name, "gemm": t}
        r["gemm_tflops"] = flops / t["median_s"] / 1e12
        if full is not None:
            r["quantize_and_gemm"] = _timed(full, sync, repeats)
        r["rel_error"] = _rel_err(out if out is not None else gemm(), exact)
        rows.append(r)

    row("fp32", lambda: a @ b.t())
    a16, b16 = a.bfloat16(), b.bfloat16()
    row("bf16", lambda: a16 @ b16.t(), lambda: a.bfloat16() @ b.bfloat16().t())
    for name in FP8_RECIPES:
        recipe = recipe_from_name(name)
        if name == "delayed":  # a warmed-up history, so the stored scale fits
            states = [DelayedState(torch.zeros(16, 1), torch.ones(1), 0) for _ in range(2)]
            for _ in range(2):
                qa = quantize_for(a, recipe, "input", states[0])
                qb = quantize_for(b, recipe, "weight", states[1])

            def quant(states=states, recipe=recipe):
                return (
                    quantize_for(a, recipe, "input", states[0]),
                    quantize_for(b, recipe, "weight", states[1]),
                )
        else:

            def quant(recipe=recipe):
                return quantize_for(a, recipe, "input"), quantize_for(b, recipe, "weight")

            qa, qb = quant()
        row(
            f"fp8 {name}",
            lambda qa=qa, qb=qb: fp8_gemm(qa, qb, torch.bfloat16),
            lambda quant=quant: fp8_gemm(*quant(), torch.bfloat16),
        )
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'shape (M,N,K)':<18}{'contender':<16}{'GEMM ms':>10}{'TFLOP/s':>10}"
    head += f"{'quant+GEMM ms':>15}{'rel err':>11}{'others':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        q = r.get("quantize_and_gemm")
        print(
            f"{'x'.join(map(str, r['shape'])):<18}{r['contender']:<16}"
            f"{r['gemm']['median_s'] * 1e3:>10.2f}{r['gemm_tflops']:>10.3f}"
            f"{(q['median_s'] * 1e3 if q else float('nan')):>15.2f}{r['rel_error']:>11.2e}"
            f"{(r['gemm']['other_cores'] or 0):>8.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="MxNxK,... (comma-separated)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="1: steadiest on a shared CPU")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    acc = get_accelerator(args.device)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    rows = []
    for m, n, k in shapes:
        rows += bench_shape(m, n, k, acc.device, acc.synchronize, args.repeats)
    print_table(rows)
    result = {
        "benchmark": "fp8_gemm",
        "machine": machine.machine_info(args.threads, args.device),
        "repeats": args.repeats,
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
