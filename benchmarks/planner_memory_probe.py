"""Where a CPU rank's peak memory goes: live bytes against resident pages, per rank.

The training self-check compares the planner with peak RSS (VmHWM) above the trainer's
pre-model baseline. This probe runs the same trainer for one layout of
`planner_validation.py` and, per rank, records beside VmHWM glibc's live bytes (`mallinfo2`:
heap chunks in use plus mmapped chunks) polled every 0.1 ms through the last step, and
the live bytes between steps; the gap between the two peaks is what the allocator keeps
resident (`hyperloom/planner/host_memory.py`; the trainer set-up is `hyperloom/train/probe.py`'s).
Results in docs/planner.md section 4.

    python benchmarks/planner_memory_probe.py --layout tp2 [--steps 4] [--out FILE]
    python benchmarks/planner_memory_probe.py --layout all     # every layout, one table

Beside each layout's peaks it puts the memory model's live estimate for the job (no
allocator terms): how well the planner counts tensors, apart from what the heap keeps.

Memory only: timing from this script means nothing (a thread polls the heap while the steps
run, and the probe's ranks share the machine with it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def _rank(layout: str, overrides: list[str], steps: int, out: Path) -> None:
    """One rank (under torchrun when the layout has several): train `steps` steps, sample."""
    import torch.distributed as dist

    from hyperloom.accelerator import peak_rss_bytes, reset_peak_rss
    from hyperloom.config import load_config
    from hyperloom.planner.host_memory import LivePoller, live_heap_bytes
    from hyperloom.train.probe import trainer_at_live_baseline

    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = out.parent / f"{out.stem}-run"
    cfg = load_config(
        HERE.parent / "configs" / "tiny.toml",
        [*overrides, "--logging.run_dir", str(run_dir), "--train.eval_batches", "1"],
        world_size=world,
    )
    trainer, base_live = trainer_at_live_baseline(cfg)
    rss0 = trainer.memory_baseline
    trainer.evaluate()
    reset_peak_rss()  # where the trainer resets it
    rows, poll = [], LivePoller()
    for i in range(steps):
        if i == steps - 1:
            with poll:
                trainer.train_step()
        else:
            trainer.train_step()
        rows.append(
            {
                "resident_peak": peak_rss_bytes() - rss0,
                "live_between_steps": (live_heap_bytes() or 0) - base_live,
            }
        )
    record = {
        "layout": layout,
        "rank": int(os.environ.get("RANK", "0")),
        "steps": rows,
        "resident_peak": max(r["resident_peak"] for r in rows),
        "live_peak_last_step": poll.peak - base_live,
    }
    record["resident_over_live"] = record["resident_peak"] / max(record["live_peak_last_step"], 1)
    Path(f"{out}.rank{record['rank']}").write_text(json.dumps(record))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def predicted_live_bytes(nproc: int, overrides: list[str]) -> float:
    """The memory model's live peak (max over ranks) for the layout, no allocator terms."""
    from hyperloom.config import load_config
    from hyperloom.planner.hardware import HardwareProfile
    from hyperloom.planner.selfcheck import CPU_PROFILE, self_check

    job = load_config(HERE.parent / "configs" / "tiny.toml", overrides, world_size=nproc)
    neutral = HardwareProfile(CPU_PROFILE, bf16_tflops=1.0, fp8_tflops=0.0, hbm_gib=1024.0,
                              hbm_gbs=1.0, gemm_eff=1.0)  # fmt: skip
    return self_check(job, neutral, nproc, None, None)["predicted_live_memory_gb"] * 1e9


def probe(
    name: str, nproc: int, steps: int, results: str, overrides: list[str] | None = None
) -> list[dict]:
    """Every rank's record for one layout (each rank a fresh process, under torchrun): one of
    `planner_validation.CONFIGS` by name, or `overrides` of configs/tiny.toml."""
    out = Path(results).with_suffix("")
    me = [str(Path(__file__).resolve()), "--layout", name, "--steps", str(steps)]
    me += ["--out", results, "--rank-worker"]
    if overrides is not None:
        me += ["--overrides", json.dumps(overrides)]
    launch = [sys.executable] + (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if nproc > 1
        else []
    )
    subprocess.run(launch + me, check=True, cwd=HERE.parent)
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(nproc)]
    for r in range(nproc):
        Path(f"{out}.rank{r}").unlink()
    return ranks


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    import machine
    from planner_validation import CONFIGS
    from rich.console import Console
    from rich.table import Table

    names = [c[0] for c in CONFIGS]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", required=True, help=f"'all' or comma-separated: {names}")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=str(HERE / "results" / "planner_memory_probe.json"))
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--overrides", default="", help=argparse.SUPPRESS)  # JSON list (`probe`)
    args = p.parse_args(argv)
    if args.rank_worker and args.overrides:
        _rank(args.layout, json.loads(args.overrides), args.steps, Path(args.out).with_suffix(""))
        return 0
    chosen = names if args.layout == "all" else args.layout.split(",")
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        p.error(f"unknown layout(s) {unknown}; choose from {names} or 'all'")
    if args.rank_worker:
        _, _, overrides = next(c for c in CONFIGS if c[0] == chosen[0])
        _rank(chosen[0], overrides, args.steps, Path(args.out).with_suffix(""))
        return 0
    results = Path(args.out)
    done = json.loads(results.read_text()) if results.exists() else {}
    table = Table(title="bytes above the trainer's pre-model baseline, MB (per rank)")
    for col in ("layout", "rank", "resident peak", "live peak", "resident / live",
                "live predicted", "prediction error"):  # fmt: skip
        table.add_column(col, justify="right")
    for name, nproc, overrides in (c for c in CONFIGS if c[0] in chosen):
        Console().print(f"{name} on {nproc} process(es) ...")
        ranks = probe(name, nproc, args.steps, args.out)
        predicted = predicted_live_bytes(nproc, overrides)
        top = max(r["live_peak_last_step"] for r in ranks)
        for r in ranks:
            r["predicted_live_max_rank"] = predicted
            r["prediction_error_max_rank"] = predicted / top - 1
            table.add_row(
                name,
                str(r["rank"]),
                f"{r['resident_peak'] / 1e6:.0f}",
                f"{r['live_peak_last_step'] / 1e6:.0f}",
                f"{r['resident_over_live']:.2f}",
                f"{predicted / 1e6:.0f}" if r["live_peak_last_step"] == top else "",
                f"{predicted / top - 1:+.1%}" if r["live_peak_last_step"] == top else "",
            )
        done[name] = ranks
    Console().print(table)
    machine.write_results(results, done)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
