"""Save and load time of the two checkpoint formats, same state, same layout.

Under torchrun, one `Trainer` per format (`checkpoint.format = whole | sharded`, synchronous
saves, the Llama of benchmarks/checkpoint_stall.py) takes a step and then saves `--saves`
times and loads the last checkpoint back; the medians of the slowest rank are reported.
`whole` gathers every tensor and the main rank writes them all; `sharded` has every rank
write its own shards through torch.distributed.checkpoint. Results go to
benchmarks/results/checkpoint_formats.json.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        benchmarks/checkpoint_formats.py --tp 2 --dp 2
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import machine  # noqa: E402 - benchmarks/ is on sys.path (scripts run from there)
from checkpoint_stall import job  # noqa: E402

from hyperloom.config import load_config  # noqa: E402
from hyperloom.parallel.mesh import exit_worker  # noqa: E402
from hyperloom.train.trainer import Trainer  # noqa: E402


def slowest(seconds: float) -> float:
    """The slowest rank's time (a save or load is over when every rank is done)."""
    t = torch.tensor(seconds, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(fmt: str, args: argparse.Namespace, tmp: Path) -> dict:
    args.format = fmt  # what checkpoint_stall.job reads
    over = job(tmp / fmt, args, async_save=False) + ["--checkpoint.keep", "1"]
    over += ["--parallel.tp", str(args.tp), "--parallel.dp", str(args.dp)]
    over += ["--parallel.zero", str(args.zero)]
    t = Trainer(load_config(None, over))
    t.train_step()
    saves = []
    for _ in range(args.saves):
        start = time.perf_counter()
        path = t.save(None)
        saves.append(slowest(time.perf_counter() - start))
    start = time.perf_counter()
    t.load_checkpoint(path)
    load = slowest(time.perf_counter() - start)
    t.guard.close()
    mb = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    return {"save_s_median": statistics.median(saves), "save_s": saves, "load_s": load, "mb": mb}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "hyperloom-ckpt-formats"))
    p.add_argument("--json", default=str(ROOT / "benchmarks/results/checkpoint_formats.json"))
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HYPERLOOM_OPS_COMPILE", "0")
    main_rank = int(os.environ.get("RANK", "0")) == 0
    work = Path(args.dir)  # the same directory for every rank
    rows = {fmt: measure(fmt, args, work) for fmt in ("whole", "sharded")}
    if dist.is_initialized():
        dist.barrier()
    if main_rank:
        shutil.rmtree(work, ignore_errors=True)
        layout = f"tp{args.tp} x dp{args.dp} (zero {args.zero})"
        print(f"checkpoint of {rows['whole']['mb']:.1f} MB, {layout}, slowest rank, median")
        print(f"{'format':<9}{'save s':>9}{'load s':>9}")
        for fmt, r in rows.items():
            print(f"{fmt:<9}{r['save_s_median']:>9.3f}{r['load_s']:>9.3f}")
        out = {"config": vars(args), "torch": torch.__version__, "formats": rows}
        out["load_average_1min"] = os.getloadavg()[0]
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        machine.write_results(args.json, out)
        print(f"wrote {args.json}")
    return exit_worker(0)


if __name__ == "__main__":
    sys.exit(main())
