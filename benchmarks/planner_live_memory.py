"""What the planner's CPU memory error is made of: per rank, the true peak of the bytes the
tensors hold (glibc's live heap) against the planner's live estimate, and the resident set size
(what the self-check measures) against both.

`planner_validation.py` compares the planner's prediction with peak RSS. On CPU that number
mixes two things: how well the memory model counts tensors, and what glibc's heap keeps
resident beyond them (`hyperloom.planner.host_memory`). This script separates them for the
same layouts of the default model: each rank runs real training steps of hyperloom's trainer
(launched by torchrun, the host allocator policy the trainer uses) under a dispatch mode that
reads glibc's in-use bytes (`mallinfo2`) after every operator; their peak above the state
before the model is the true live peak. No timing: it runs on a busy machine as well.

    python benchmarks/planner_live_memory.py [--only single,tp2] [--steps 6]

Writes `results/planner_live_memory.json`. Linux with glibc only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
JOB = HERE.parent / "configs" / "tiny.toml"


def worker(out_dir: str, steps: int, overrides: list[str]) -> None:
    """One rank (started by torchrun): train `steps` steps under the sampler, write its peaks."""
    import torch  # noqa: F401 - before the allocator policy, as the trainer's own process
    from torch.utils._python_dispatch import TorchDispatchMode

    from hyperloom.accelerator import configure_host_allocator, peak_rss_bytes
    from hyperloom.config import load_config
    from hyperloom.engine.ops.kernels import preload_triton
    from hyperloom.planner.host_memory import _mallinfo2
    from hyperloom.train.trainer import Trainer

    configure_host_allocator("cache")  # what the Trainer would set first
    preload_triton()  # as the Trainer does before its baseline
    info = _mallinfo2()
    if info is None:
        raise SystemExit("no glibc mallinfo2 here")

    def live() -> int:
        m = info()
        return m.uordblks + m.hblkhd

    base = live()
    with tempfile.TemporaryDirectory() as run_dir:
        job = load_config(
            JOB,
            [*overrides, "--logging.run_dir", run_dir, "--logging.progress", "false",
             "--checkpoint.every", "0", "--train.eval_batches", "1"],
        )  # fmt: skip
        trainer = Trainer(job)
        peak = base

        class Sample(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                nonlocal peak
                out = func(*args, **(kwargs or {}))
                peak = max(peak, live())
                return out

        with Sample():
            for _ in range(steps):
                trainer.train_step()
        rank = int(os.environ.get("RANK", "0"))
        record = {
            "rank": rank,
            "live_gb": (peak - base) / 1e9,
            "resident_gb": (peak_rss_bytes() - trainer.memory_baseline) / 1e9,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
        trainer.guard.close()
    os._exit(0)  # no gloo teardown at interpreter exit


def predicted_live_gb(nproc: int, overrides: list[str]) -> float:
    """The memory model's live peak (max over ranks) for the job, no allocator terms."""
    from hyperloom.config import load_config
    from hyperloom.planner.hardware import Accelerator
    from hyperloom.planner.selfcheck import CPU_PROFILE, self_check

    job = load_config(JOB, overrides, world_size=nproc)
    neutral = Accelerator(CPU_PROFILE, bf16_tflops=1.0, fp8_tflops=0.0, hbm_gib=1024.0,
                          hbm_gbs=1.0, gemm_eff=1.0)  # fmt: skip
    return self_check(job, neutral, nproc, None, None)["predicted_live_memory_gb"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(name: str, nproc: int, overrides: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(_free_port()), __file__, "--worker", out, "--steps", str(steps),
            "--", *overrides,
        ]  # fmt: skip
        done = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        ranks = sorted(
            (json.loads(p.read_text()) for p in Path(out).glob("rank*.json")),
            key=lambda r: r["rank"],
        )
    if done.returncode != 0 or len(ranks) != nproc:
        return {"name": name, "error": done.stderr[-2000:]}
    top = max(ranks, key=lambda r: r["live_gb"])
    predicted = predicted_live_gb(nproc, overrides)
    return {
        "name": name,
        "processes": nproc,
        "overrides": overrides,
        "ranks": ranks,
        "live_gb": top["live_gb"],
        "predicted_live_gb": predicted,
        "live_error": predicted / top["live_gb"] - 1,
        "resident_gb": max(r["resident_gb"] for r in ranks),
        "resident_over_live": [r["resident_gb"] / r["live_gb"] for r in ranks],
        "resident_minus_live_gb": [r["resident_gb"] - r["live_gb"] for r in ranks],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated config names")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=str(HERE / "results" / "planner_live_memory.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.overrides)
        return 0

    import machine
    from planner_validation import CONFIGS
    from rich.console import Console
    from rich.table import Table

    console = Console()
    chosen = [c for c in CONFIGS if not args.only or c[0] in args.only.split(",")]
    results = []
    for i, (name, nproc, extra) in enumerate(chosen, 1):
        console.print(f"[{i}/{len(chosen)}] {name} on {nproc} process(es) ...")
        results.append(measure(name, nproc, extra, args.steps))
    table = Table(title="planner live estimate vs glibc's live peak vs resident (GB, max rank)")
    for col in ("config", "live meas", "live pred", "err", "resident", "resident/live",
                "resident - live"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in results:
        if "error" in r:
            table.add_row(r["name"], "run failed", *[""] * 5)
            continue
        table.add_row(
            r["name"],
            f"{r['live_gb']:.3f}",
            f"{r['predicted_live_gb']:.3f}",
            f"{r['live_error']:+.1%}",
            f"{r['resident_gb']:.3f}",
            "-".join(f"{v:.2f}" for v in (min(r["resident_over_live"]),
                                          max(r["resident_over_live"]))),
            "-".join(f"{v:.2f}" for v in (min(r["resident_minus_live_gb"]),
                                          max(r["resident_minus_live_gb"]))),
        )  # fmt: skip
    console.print(table)
    ok = [r for r in results if "error" not in r]
    if ok:
        within = sum(abs(r["live_error"]) <= 0.10 for r in ok)
        console.print(f"live estimate within 10% of the live peak: {within}/{len(ok)}")
    record = {
        "machine": machine.machine_info(1, "cpu"),
        "revision": machine.hyperloom_revision(),
        "steps": args.steps,
        "results": results,
    }
    machine.write_results(args.out, record)
    console.print(f"wrote {args.out}")
    for r in results:
        if "error" in r:
            console.print(f"[red]{r['name']} failed[/red]:\n{r['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
