"""Training stall per checkpoint save: asynchronous vs synchronous, same state, same trainer.

One `Trainer` (a Llama a little larger than `tiny`'s test size, so that a save writes tens
of MB: weights plus two Adam moments in FP32) runs blocks of `--every` optimizer steps; after
each block it either does nothing (baseline), saves synchronously, or saves asynchronously
(`checkpoint.async_save`: stage a CPU copy, write in a background thread). The modes take
turns, block by block, so slow drifts of a shared machine hit all of them alike.

Two stalls per save are reported:

- **blocking**: the time `Trainer.save()` keeps the training thread (for async: gathering,
  staging the copy, and waiting for the previous save if it is still writing);
- **total**: the extra wall time of a block that ends with a save over the median block that
  does not, which also counts the background writer slowing the next steps down (it shares
  the CPU cores, and the GIL for its Python parts).

The target is an async total stall of at most 10% of the synchronous one. On a shared
machine the total stall is only as good as the spread of the baseline blocks (printed): a
background writer needs a core, and when every core is busy its work shows up as stall. The last save of
each async block is waited for before the next block starts, so no write leaks into the
baseline's blocks. Results go to benchmarks/results/checkpoint_stall.json.

    python benchmarks/checkpoint_stall.py                 # ~1 min on 2 CPU cores
    python benchmarks/checkpoint_stall.py --blocks 3 --dim 256
    python benchmarks/checkpoint_stall.py --format sharded  # DCP: every rank its shards
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402 - benchmarks/ is on sys.path (scripts run from there)

from hyperloom.config import load_config  # noqa: E402
from hyperloom.train.trainer import Trainer  # noqa: E402


def job(run_dir: Path, args: argparse.Namespace, async_save: bool) -> list[str]:
    run_dir.mkdir(parents=True, exist_ok=True)  # Trainer.run() would make it; we drive steps
    values = {
        "model.dim": args.dim,
        "model.n_layers": args.layers,
        "model.n_heads": 8,
        "model.n_kv_heads": 4,
        "model.ffn_dim": 4 * args.dim,
        "model.vocab_size": 4096,
        "model.max_seq_len": 128,
        "data.seq_len": 128,
        "data.max_corpus_mb": 2,
        "data.val_fraction": 0.2,
        "train.eval_batches": 1,
        "train.micro_batch_size": 4,
        "train.steps": 10_000,
        "train.device": "cpu",
        "precision.dtype": "fp32",
        "logging.run_dir": str(run_dir),
        "logging.progress": "false",
        "logging.self_check": "off",
        "checkpoint.keep": 2,
        "checkpoint.async_save": str(async_save).lower(),
        "checkpoint.format": args.format,
        "resilience.on_anomaly": "none",
    }
    return [x for k, v in values.items() for x in (f"--{k}", str(v))]


def block(trainer: Trainer, steps: int) -> None:
    for _ in range(steps):
        trainer.train_step()
    trainer.acc.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--every", type=int, default=8, help="steps between saves")
    p.add_argument("--blocks", type=int, default=3, help="blocks per mode")
    p.add_argument("--format", choices=["whole", "sharded"], default="whole")
    p.add_argument("--json", help="default benchmarks/results/checkpoint_stall[_sharded].json")
    args = p.parse_args()
    suffix = "_sharded" if args.format == "sharded" else ""
    args.json = args.json or str(ROOT / f"benchmarks/results/checkpoint_stall{suffix}.json")
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HYPERLOOM_OPS_COMPILE", "0")

    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            mode: Trainer(load_config(None, job(Path(tmp) / mode, args, mode == "async")))
            for mode in ("sync", "async")
        }
        base_trainer = trainers["sync"]
        for t in trainers.values():
            block(t, 2)  # warm-up
        blocks: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        blocking: dict[str, list[float]] = {"sync": [], "async": []}
        for _ in range(args.blocks):
            for mode in ("none", "sync", "async"):
                t = base_trainer if mode == "none" else trainers[mode]
                start = time.perf_counter()
                block(t, args.every)
                if mode != "none":
                    s0 = time.perf_counter()
                    t.save(None)
                    blocking[mode].append(time.perf_counter() - s0)
                    block(t, args.every)  # the steps the background write overlaps
                else:
                    block(t, args.every)
                blocks[mode].append(time.perf_counter() - start)
                if mode == "async":
                    t.guard.writer.wait()  # nothing leaks into the next block
        state_mb = (
            sum(f.stat().st_size for f in (Path(tmp) / "sync").rglob("*") if f.is_file()) / 2 / 1e6
        )  # two checkpoints kept
        for t in trainers.values():
            t.guard.close()

    base = statistics.median(blocks["none"])
    step_s = base / (2 * args.every)
    rows = {}
    for mode in ("sync", "async"):
        rows[mode] = {
            "blocking_s_median": statistics.median(blocking[mode]),
            "total_stall_s_median": max(statistics.median(blocks[mode]) - base, 0.0),
            "blocking_s": blocking[mode],
            "block_s": blocks[mode],
        }
    ratio = rows["async"]["total_stall_s_median"] / max(rows["sync"]["total_stall_s_median"], 1e-9)
    block_ratio = rows["async"]["blocking_s_median"] / rows["sync"]["blocking_s_median"]
    print(f"checkpoint of {state_mb:.1f} MB, step {step_s * 1e3:.1f} ms, save every {args.every}")
    print(f"{'mode':<8}{'blocking s':>12}{'total stall s':>15}{'stall / step':>14}")
    for mode, r in rows.items():
        print(
            f"{mode:<8}{r['blocking_s_median']:>12.4f}{r['total_stall_s_median']:>15.4f}"
            f"{r['total_stall_s_median'] / step_s:>14.2f}"
        )
    noise = max(blocks["none"]) - min(blocks["none"])
    print(f"async / sync: blocking {100 * block_ratio:.1f}%, total stall {100 * ratio:.1f}%")
    print(
        f"baseline blocks {min(blocks['none']):.3f}..{max(blocks['none']):.3f} s (spread "
        f"{noise:.3f} s: total stalls below it are noise); load average {os.getloadavg()[0]:.2f}"
    )
    out = {
        "config": vars(args),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "checkpoint_mb": state_mb,
        "step_s": step_s,
        "baseline_block_s": blocks["none"],
        "baseline_spread_s": noise,
        "load_average_1min": os.getloadavg()[0],
        "modes": rows,
        "async_over_sync_blocking": block_ratio,
        "async_over_sync_total_stall": ratio,
        "target": 0.10,
        "met": ratio <= 0.10,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    machine.write_results(args.json, out)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
