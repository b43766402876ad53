"""Where a CPU rank's peak memory goes: live bytes against resident pages, per rank.

The training self-check compares the planner with peak RSS (VmHWM) above the trainer's
pre-model baseline. This probe runs the same trainer for one layout of
`planner_validation.py` and, per rank, records beside VmHWM glibc's live bytes (`mallinfo2`:
heap chunks in use plus mmapped chunks) sampled after every operator of the last step, and
the live bytes between steps; the gap between the two peaks is what the allocator keeps
resident (`hyperloom/planner/host_memory.py`). Results in docs/planner.md section 4.

    python benchmarks/planner_memory_probe.py --layout tp2 [--steps 4] [--out FILE]

Memory only: timing from this script means nothing (the sampler runs Python per operator).
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

    from hyperloom.accelerator import Accelerator, peak_rss_bytes, reset_peak_rss
    from hyperloom.config import load_config
    from hyperloom.engine.ops.memory import AllocationTracker
    from hyperloom.planner.host_memory import live_heap_bytes
    from hyperloom.train.trainer import Trainer

    class Sampler(AllocationTracker):  # new tensor bytes, and the live heap after every op
        peak_live = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = super().__torch_dispatch__(func, types, args, kwargs)
            Sampler.peak_live = max(Sampler.peak_live, live_heap_bytes() or 0)
            return result

    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = out.parent / f"{out.stem}-run"
    cfg = load_config(
        HERE.parent / "configs" / "tiny.toml",
        [*overrides, "--logging.run_dir", str(run_dir), "--train.eval_batches", "1"],
        world_size=world,
    )
    cpu = Accelerator("cpu")
    base: dict[str, int] = {}
    take = cpu.current_memory_bytes

    def baseline_too() -> int:  # the trainer's baseline, and the live heap at that moment
        base.setdefault("live", live_heap_bytes() or 0)
        return take()

    cpu_type = type(cpu)
    cpu_type.current_memory_bytes = lambda self: baseline_too()
    trainer = Trainer(cfg)
    cpu_type.current_memory_bytes = lambda self: take()
    rss0 = trainer.memory_baseline
    trainer.evaluate()
    reset_peak_rss()  # where the trainer resets it
    rows = []
    for i in range(steps):
        if i == steps - 1:
            with Sampler():
                trainer.train_step()
        else:
            trainer.train_step()
        rows.append(
            {
                "resident_peak": peak_rss_bytes() - rss0,
                "live_between_steps": (live_heap_bytes() or 0) - base["live"],
            }
        )
    record = {
        "layout": layout,
        "rank": int(os.environ.get("RANK", "0")),
        "steps": rows,
        "resident_peak": max(r["resident_peak"] for r in rows),
        "live_peak_last_step": Sampler.peak_live - base["live"],
    }
    record["resident_over_live"] = record["resident_peak"] / max(record["live_peak_last_step"], 1)
    Path(f"{out}.rank{record['rank']}").write_text(json.dumps(record))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    import machine
    from planner_validation import CONFIGS
    from rich.console import Console
    from rich.table import Table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", required=True, choices=[c[0] for c in CONFIGS])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=str(HERE / "results" / "planner_memory_probe.json"))
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    name, nproc, overrides = next(c for c in CONFIGS if c[0] == args.layout)
    out = Path(args.out).with_suffix("")
    if args.rank_worker:
        _rank(name, overrides, args.steps, out)
        return 0
    me = [str(Path(__file__).resolve()), "--layout", name, "--steps", str(args.steps)]
    me += ["--out", args.out, "--rank-worker"]
    launch = [sys.executable] + (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if nproc > 1
        else []
    )
    subprocess.run(launch + me, check=True, cwd=HERE.parent)
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(nproc)]
    for r in range(nproc):
        Path(f"{out}.rank{r}").unlink()
    table = Table(title=f"{name}: bytes above the trainer's pre-model baseline, MB")
    for col in ("rank", "resident peak", "live peak", "resident / live", "live between steps"):
        table.add_column(col, justify="right")
    for r in ranks:
        table.add_row(
            str(r["rank"]),
            f"{r['resident_peak'] / 1e6:.0f}",
            f"{r['live_peak_last_step'] / 1e6:.0f}",
            f"{r['resident_over_live']:.2f}",
            f"{r['steps'][-1]['live_between_steps'] / 1e6:.0f}",
        )
    Console().print(table)
    results = Path(args.out)
    done = json.loads(results.read_text()) if results.exists() else {}
    done[name] = ranks
    machine.write_results(results, done)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
