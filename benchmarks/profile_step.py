"""Where a training step's time goes, op by op, for each contender of `train_throughput.py`.

When the throughput benchmark shows a gap, this answers "which op differs?": every contender
is built exactly as there (same shape, weights, batches and step), warmed up, and then a few
single steps run under `torch.profiler`. The step that other processes disturbed least is
kept (see `machine.py`), and the ops' self CPU time is printed side by side
and written to JSON. Self times add up to the step; one op's row across contenders shows what
each implementation spends on it (e.g. `aten::copy_` holds `repeat_interleave`'s copies).

    python benchmarks/profile_step.py                  # bf16, all three contenders
    python benchmarks/profile_step.py --dtype fp32 --top 40
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import machine  # benchmarks/ is on sys.path (scripts run from there)
import torch
from contenders import CONTENDERS, Spec, build_runner

from hyperloom.accelerator import get_accelerator
from hyperloom.config import DataConfig, ModelConfig, PrecisionConfig, TrainConfig

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "profile_step.json"


def profile_one(name: str, spec: Spec, tries: int) -> dict[str, Any]:
    """Worker: the op table (self time, calls) of the least disturbed of `tries` steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(spec.threads)
    acc = get_accelerator(spec.device)
    _, step = build_runner(name, spec, acc)
    for _ in range(spec.warmup):
        step()
    activities = [ProfilerActivity.CPU]
    if acc.kind == "cuda":
        activities.append(ProfilerActivity.CUDA)
    best: dict[str, Any] | None = None
    for _ in range(tries):
        acc.synchronize()
        c0, t0 = machine.cpu_seconds(), time.perf_counter()
        with profile(activities=activities) as prof:
            step()
            acc.synchronize()
        wall, c1 = time.perf_counter() - t0, machine.cpu_seconds()
        other = ((c1[0] - c0[0]) - (c1[1] - c0[1])) / wall if c0 and c1 else 0.0
        key = (other > machine.BUSY_CORES, wall)  # quiet steps first, then the fastest
        if best is None or key < best["key"]:
            ops = {
                e.key: {"self_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                for e in prof.key_averages()
            }
            best = {"key": key, "step_s": wall, "other_cpu_cores": max(0.0, other), "ops": ops}
    assert best is not None
    del best["key"]
    return {"name": name, **best}


def print_ops(profiles: dict[str, dict[str, Any]], top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    names = list(profiles)
    ops = set().union(*(p["ops"] for p in profiles.values()))

    def self_ms(name: str, op: str) -> float:
        return profiles[name]["ops"].get(op, {}).get("self_ms", 0.0)

    ranked = sorted(ops, key=lambda op: -max(self_ms(n, op) for n in names))[:top]
    table = Table(title="self CPU time per op in one training step (ms, calls)")
    table.add_column("op")
    for n in names:
        table.add_column(n, justify="right")
    for op in ranked:
        cells = []
        for n in names:
            stat = profiles[n]["ops"].get(op)
            cells.append(f"{stat['self_ms']:8.1f} ({stat['calls']})" if stat else "-")
        table.add_row(op[:60], *cells)
    table.add_row(
        "[bold]step wall time[/bold]",
        *(
            f"{profiles[n]['step_s'] * 1e3:8.1f} (other load {profiles[n]['other_cpu_cores']:.2f})"
            for n in names
        ),
    )
    (Console() if sys.stdout.isatty() else Console(width=150)).print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=PrecisionConfig().dtype)
    p.add_argument("--micro-batch", type=int, default=TrainConfig().micro_batch_size)
    p.add_argument("--seq-len", type=int, default=DataConfig().seq_len)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--device", default="auto")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tries", type=int, default=4, help="profiled steps; the quietest is kept")
    p.add_argument("--top", type=int, default=25, help="ops shown")
    p.add_argument("--only", default=",".join(CONTENDERS))
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    if set(names) - set(CONTENDERS):
        raise SystemExit(f"--only: contenders are {', '.join(CONTENDERS)}")
    spec = Spec(
        model=ModelConfig(),
        dtype=args.dtype,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        warmup=args.warmup,
        steps=args.tries,
        threads=args.threads,
        device=args.device,
    )
    profiles = {}
    ctx = mp.get_context("spawn")
    for name in names:
        machine.wait_for_quiet()
        with cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            profiles[name] = pool.submit(profile_one, name, spec, args.tries).result()
        print(f"{name}: profiled step {profiles[name]['step_s'] * 1e3:.0f} ms", flush=True)
    print_ops(profiles, args.top)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "profile_step",
        "machine": machine.machine_info(spec.threads, spec.device),
        "config": {"dtype": spec.dtype, "micro_batch": spec.micro_batch, "seq_len": spec.seq_len},
        "profiles": profiles,
    }
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
