"""How much of the expert-parallel all-to-all time `parallel.ep_overlap` hides on this machine.

Each layout (the moe-tiny preset, experts split over ep; pipelined, or at pp = 1 with
`--microbatches` accumulated micro-batches, micro-batch i's forward beside i-1's backward)
trains with the overlap off and on, from the same weights and batches, in one torchrun launch
per layout (gloo on CPU); every rank times each step and reads
`hyperloom.parallel.overlap.STATS`:

- a2a in flight: the start-to-completion time of every all-to-all (dispatch and combine,
  forward and backward), per step, summed over the rank's collectives;
- exposed: the part of it a rank sat waiting in `work.wait()` -- what the step pays;
- in pairs: the same two sums over the all-to-alls inside overlapped F&B pairs only, whose
  ratio gives the hidden share, 1 - exposed / in flight: the fraction of a paired all-to-all
  the other micro-batch's compute covered. The planner's `Runtime.ep_pair_hidden` for this
  runtime is that measured share.

Medians over the timed steps (after `--warmup`), averaged over ranks. With more processes than
cores (world 4 and 8 on 2 cores) compute is oversubscribed: a2a time then includes waiting for
descheduled peers, which the overlap can hide as well. The losses of both runs must be equal
(the overlap changes no number); the script exits 1 otherwise. `--plot` draws one pair's
timeline (rank 0's pair of the last step with the most all-to-alls).

    python benchmarks/ep_overlap.py --json benchmarks/results/ep_overlap.json --plot benchmarks/results/ep_overlap.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {  # name -> (world size, parallel args)
    "ep2 dualpipe": (
        4,
        "--parallel.pp 2 --parallel.dp 2 --parallel.ep 2 --parallel.pp_schedule dualpipe",
    ),
    "ep2 interleaved": (
        4,
        "--parallel.pp 2 --parallel.dp 2 --parallel.ep 2 --parallel.pp_schedule interleaved "
        "--parallel.vpp 2",
    ),
    "ep4 dualpipe": (
        8,
        "--parallel.pp 2 --parallel.dp 4 --parallel.ep 4 --parallel.pp_schedule dualpipe",
    ),
    # pp = 1: gradient accumulation's pairs (`parallel.overlap_accum`)
    "ep2 accum ddp": (2, "--parallel.dp 2 --parallel.ep 2 --parallel.zero 0"),
    "ep2 accum zero1": (2, "--parallel.dp 2 --parallel.ep 2 --parallel.zero 1"),
    "ep4 accum ddp": (4, "--parallel.dp 4 --parallel.ep 4 --parallel.zero 0"),
}


def job_args(
    seq: int, mbs: int, steps: int, microbatches: int, run_dir: str, pipelined: bool = True
) -> list[str]:
    """The job; `microbatches` per step: the pipeline's, or at pp = 1 train.grad_accum."""
    per_step = ("--parallel.microbatches", str(microbatches))
    if not pipelined:
        per_step = ("--train.grad_accum", str(microbatches))
    return [
        *("--model.preset", "moe-tiny", "--data.seq_len", str(seq)),
        *("--data.max_corpus_mb", "2", "--data.val_fraction", "0.1"),
        *("--train.micro_batch_size", str(mbs), "--train.eval_every", "0"),
        *("--train.eval_batches", "1"),
        *("--train.steps", str(steps), "--train.warmup_steps", "1", "--train.device", "cpu"),
        *("--precision.dtype", "fp32", *per_step),
        *("--logging.progress", "false", "--logging.plot", "false"),
        *("--logging.self_check", "off", "--logging.run_dir", run_dir),
    ]


def worker(spec_path: str) -> None:
    """One layout under torchrun: off then on, each `steps` steps timed."""
    import torch
    import torch.distributed as dist

    from hyperloom.config import load_config
    from hyperloom.parallel import overlap
    from hyperloom.parallel.mesh import exit_worker
    from hyperloom.train.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    world = int(os.environ["WORLD_SIZE"])
    result: dict = {}
    for mode in ("off", "on"):
        args = [*spec["args"], "--parallel.ep_overlap", "true" if mode == "on" else "false"]
        trainer = Trainer(load_config(None, args, world_size=world))
        rows = []
        for _ in range(spec["steps"]):
            dist.barrier()
            overlap.STATS.reset()
            start = time.perf_counter()
            loss, _ = trainer.train_step()
            loss = float(trainer.dp_mean(loss))
            s = overlap.STATS
            mine = [time.perf_counter() - start, s.in_flight_s, s.exposed_s]
            mine += [s.paired_in_flight_s, s.paired_exposed_s, loss]
            everyone = [torch.zeros(len(mine), dtype=torch.float64) for _ in range(world)]
            dist.all_gather(everyone, torch.tensor(mine, dtype=torch.float64))
            rows.append(torch.stack(everyone).mean(0).tolist())
        trace = []
        ex = getattr(trainer.pm, "executor", None)
        pairs = [(str(act), duet) for act, duet in ex.trace] if ex is not None else []
        if trainer.overlapped is not None:  # pp = 1: F_i & B_{i-1}
            pairs = [("&".join(duet.labels), duet) for duet in trainer.overlapped.trace]
        if mode == "on" and pairs:  # the pair with the most a2a
            act, duet = max(pairs, key=lambda t: sum(sp.kind == "all-to-all" for sp in t[1].trace))
            trace = [[sp.lane, sp.kind, sp.start, sp.end] for sp in duet.trace]
            trace = {"pair": act, "labels": list(duet.labels), "spans": trace}
        result[mode] = {"steps": rows, "trace": trace}
        dist.barrier()
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(result))
    sys.exit(exit_worker(0))


def run_layout(name: str, world: int, parallel: str, a: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{name.replace(' ', '_')}.json"
    spec = tmp / f"{name.replace(' ', '_')}_spec.json"
    run_dir, pipelined = str(tmp / "run"), "--parallel.pp" in parallel
    args = job_args(a.seq_len, a.micro_batch, a.steps, a.microbatches, run_dir, pipelined)
    args += parallel.split()
    spec.write_text(json.dumps({"args": args, "steps": a.steps, "out": str(out)}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={world}", __file__, "--worker", str(spec)]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{name}: the worker failed")
    raw = json.loads(out.read_text())
    summary = {"world": world, "args": parallel, "wall_s": time.perf_counter() - started}
    for mode in ("off", "on"):
        timed = raw[mode]["steps"][a.warmup :]
        cols = list(zip(*timed, strict=True))
        med = [statistics.median(c) for c in cols]
        summary[mode] = {
            "step_s": med[0],
            "a2a_in_flight_s": med[1],
            "a2a_exposed_s": med[2],
            "paired_in_flight_s": med[3],
            "paired_exposed_s": med[4],
            "hidden_share_in_pairs": 1 - med[4] / med[3] if med[3] else None,
            "losses": [r[5] for r in raw[mode]["steps"]],
            "per_step": raw[mode]["steps"],
        }
    summary["trace"] = raw["on"]["trace"]
    summary["same_losses"] = summary["off"]["losses"] == summary["on"]["losses"]
    return summary


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traced = [(n, r["trace"]) for n, r in results.items() if r["trace"]]
    fig, axes = plt.subplots(len(traced), 1, figsize=(11, 1.9 * len(traced)), squeeze=False)
    for ax, (name, tr) in zip(axes[:, 0], traced, strict=True):
        for lane, kind, start, end in tr["spans"]:
            ms = (start * 1e3, (end - start) * 1e3)
            if kind == "compute":
                ax.broken_barh([ms], (lane * 2 + 0.9, 0.8), color="tab:blue")
            elif kind.endswith(":wait"):
                ax.broken_barh([ms], (lane * 2 + 0.1, 0.8), color="tab:red")
            else:
                ax.broken_barh([ms], (lane * 2 + 0.1, 0.8), color="tab:orange", alpha=0.6)
        ax.set_yticks([0.5, 1.3, 2.5, 3.3])
        labels = tr["labels"]
        ax.set_yticklabels(
            [f"{labels[0]} comm", f"{labels[0]} compute"]
            + [f"{labels[1]} comm", f"{labels[1]} compute"]
        )
        ax.set_title(
            f"{name}: rank 0, pair {tr['pair']} (orange: all-to-all in flight, red: exposed wait)",
            fontsize=9,
        )
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--only", default=",".join(LAYOUTS), help="comma-separated layout names")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument(
        "--microbatches", type=int, default=8, help="per step: pipelined, or grad_accum at pp 1"
    )
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write one pair's timeline per layout here (PNG)")
    a = p.parse_args()
    if a.worker:
        worker(a.worker)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    import machine

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.only.split(","):
            world, parallel = LAYOUTS[name]
            print(f"[{name}] world {world}: off and on, {a.steps} steps each ...", flush=True)
            results[name] = run_layout(name, world, parallel, a, Path(tmp))
    head = f"{'layout':17} {'overlap':7} {'step s':>7} {'a2a s':>7} {'exposed':>8} {'pairs: a2a':>10} {'exposed':>8} {'hidden':>7}"
    print(head)
    for name, r in results.items():
        for mode in ("off", "on"):
            m = r[mode]
            share = m["hidden_share_in_pairs"]
            print(
                f"{name:17} {mode:7} {m['step_s']:7.3f} {m['a2a_in_flight_s']:7.3f} "
                f"{m['a2a_exposed_s']:8.3f} {m['paired_in_flight_s']:10.3f} "
                f"{m['paired_exposed_s']:8.3f} {'' if share is None else f'{share:7.1%}'}"
            )
        saved = r["off"]["a2a_exposed_s"] - r["on"]["a2a_exposed_s"]
        print(
            f"{'':17} exposed a2a per step falls by {saved:.3f} s; losses equal: {r['same_losses']}"
        )
    if a.json:
        payload = {
            "machine": machine.machine_info(threads=0, device="cpu"),
            "revision": machine.hyperloom_revision(),
            "config": vars(a),
            "results": results,
        }
        machine.write_results(a.json, payload)
        print(f"wrote {a.json}")
    if a.plot:
        plot(results, a.plot)
        print(f"wrote {a.plot}")
    if not all(r["same_losses"] for r in results.values()):
        raise SystemExit("the overlap changed the losses")


if __name__ == "__main__":
    main()
