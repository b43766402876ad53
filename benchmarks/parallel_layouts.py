"""Parallel layouts on this machine: tokens/s, per-rank memory and loss parity of each layout.

Every layout trains the same job -- the default `tiny` Llama at seq 256, the same global batch
(default 8 sequences, so the micro-batch is 8 / dp per rank), seed and data -- for a few steps.
A layout runs the library's own `Trainer.run()`, launched as `hyperloom train --nproc N`
launches it (`torch.distributed.run --standalone`, gloo on CPU; one process runs directly), in
a worker that also samples what each rank holds after every optimizer step. Each run has its
own temporary run directory; the data cache (`HYPERLOOM_CACHE`) is shared and filled once.

What is measured, per layout:

- tokens/s: with `logging.log_every 1` every metrics.jsonl record covers exactly one step, and
  its `tokens_per_s` is the step's global tokens over its wall time (up to and including the
  loss read-back). We report the median over the steps after the first `--warmup` (default 2:
  steps 3..6 of 6); every step's value goes to the JSON.
- peak RSS per rank: each process's resident high-water mark (VmHWM) read at its last optimizer
  step, so it covers start-up, data, model, the initial evaluation and every training step --
  but not the end-of-run checkpoint, which gathers whole tensors on every rank and could hide
  the sharding. (The trainer's summary.json `peak_memory_gb_per_rank`, `ru_maxrss` at the very
  end, is kept in the JSON; here the two agree.) On CPU the RSS includes the interpreter, torch
  and the token arrays: about 0.45 GB per process once set up (`setup_peak_rss_gb_per_rank`).
- state per rank: `hyperloom.parallel.footprint.local_state_bytes` after the optimizer step --
  parameters, gradients, Adam moments and ZeRO-1's FP32 master slice, the part a layout
  promises to divide; buffers (DDP buckets, FSDP all-gathers, ZeRO-1's flat copies) and
  activations are not in it, only in the RSS.
- loss diff: the largest relative difference of the per-step training loss (dp-averaged, as
  logged) from the single-process run. Under `--dtype fp32` every layout must agree to 1e-5 or
  the benchmark exits 1; under bf16 the numbers are reported only.
- other load: CPU cores other processes used during the timed steps (/proc/stat minus every
  rank's own CPU time, read at each optimizer step). A run above `machine.BUSY_CORES` (0.2) is
  retried (`--retries`, default 2) after waiting up to `--quiet-wait` s for a quiet machine;
  the least disturbed attempt is reported, marked `!` if it was still contended.

Processes vs cores: each process gets cores / processes OpenMP threads (at least one), so a
2-process layout on 2 cores uses the same two cores as one 2-thread process. With more
processes than cores (`--world 4` here) the numbers measure oversubscription, not scaling.

    python benchmarks/parallel_layouts.py                      # bf16, world sizes 1 and 2
    python benchmarks/parallel_layouts.py --dtype fp32 --json benchmarks/results/parallel_layouts_fp32.json
    python benchmarks/parallel_layouts.py --world 4 --only single,dp4-zero3,dp2-tp2
    python benchmarks/parallel_layouts.py --dtype fp32 --seq-len 8192 --global-batch 1 \
        --steps 3 --warmup 1 --only single,cp2-ring,cp2-alltoall,cp4-ring \
        --json benchmarks/results/context_parallel_8192.json     # cp: activations ~ 1/cp
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import machine  # benchmarks/ is on sys.path (scripts run from there)

LOSS_RTOL = 1e-5  # fp32: every layout's per-step loss must match one process's this closely
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "parallel_layouts.json"
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "hyperloom-bench-cache"
WORKER_FLAG, PREPARE_FLAG = "--worker", "--prepare-data"
GB = 1e9  # decimal, as the trainer's peak_memory_gb
MB = 1e6


@dataclass(frozen=True)
class Layout:
    """One parallel layout; its processes are dp * tp * cp."""

    name: str
    dp: int = 1
    tp: int = 1
    sp: bool = False
    zero: int = 0
    cp: int = 1
    cp_comm: str = "ring"

    @property
    def nproc(self) -> int:
        return self.dp * self.tp * self.cp

    def overrides(self) -> list[str]:
        return [
            *("--parallel.dp", str(self.dp), "--parallel.tp", str(self.tp)),
            *("--parallel.sp", str(self.sp).lower(), "--parallel.zero", str(self.zero)),
            *("--parallel.cp", str(self.cp), "--parallel.cp_comm", self.cp_comm),
        ]


# The tiny preset has 6 query and 2 key/value heads, so tp can only be 1 or 2.
LAYOUTS = (
    Layout("single"),
    Layout("dp2-zero0", dp=2),
    Layout("dp2-zero1", dp=2, zero=1),
    Layout("dp2-zero3", dp=2, zero=3),
    Layout("tp2", tp=2),
    Layout("tp2-sp", tp=2, sp=True),
    Layout("dp4-zero0", dp=4),
    Layout("dp4-zero1", dp=4, zero=1),
    Layout("dp4-zero3", dp=4, zero=3),
    Layout("dp2-tp2", dp=2, tp=2),
    Layout("dp2-tp2-sp", dp=2, tp=2, sp=True),
    Layout("dp2-zero3-tp2-sp", dp=2, tp=2, sp=True, zero=3),
    # context parallelism (6 query heads: all-to-all only at cp 2)
    Layout("cp2-ring", cp=2),
    Layout("cp2-alltoall", cp=2, cp_comm="alltoall"),
    Layout("cp4-ring", cp=4),
    Layout("dp2-cp2-zero1", dp=2, cp=2, zero=1),
)


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def job_overrides(args: argparse.Namespace, layout: Layout, run_dir: Path) -> list[str]:
    """The `--section.key value` overrides of one layout's job (what `hyperloom train` takes)."""
    return [
        *("--model.preset", "tiny", "--data.seq_len", str(args.seq_len)),
        *("--model.max_seq_len", str(max(args.seq_len, 2048))),  # tiny's own is 2048
        *("--precision.dtype", args.dtype, "--train.device", "cpu"),
        *("--train.steps", str(args.steps), "--train.grad_accum", "1"),
        *("--train.micro_batch_size", str(args.global_batch // layout.dp)),
        *("--train.eval_every", "0", "--train.eval_batches", "1"),
        # 4 MB of the corpus; 5% held out so one validation batch of 8 x 256 fits.
        *("--data.max_corpus_mb", str(args.corpus_mb), "--data.val_fraction", "0.05"),
        *("--logging.run_dir", str(run_dir), "--logging.log_every", "1"),
        *("--logging.progress", "false", "--logging.plot", "false"),
        *("--logging.sample_tokens", "0", "--logging.peak_tflops", "1"),  # 1: MFU not measured
        *("--checkpoint.every", "0", "--checkpoint.resume", "none"),
        *layout.overrides(),
    ]


# --------------------------------------------------------------------------- worker


def prepare_data(overrides: list[str]) -> int:
    """Fill the data cache (tokenizer, token arrays) once, before anything is measured."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from hyperloom.config import load_config
    from hyperloom.data import build_data

    cfg = load_config(None, overrides, world_size=1)
    build_data(cfg.data, cfg.model.vocab_size)
    return 0


def worker(out_path: Path, overrides: list[str]) -> None:
    """One rank of one layout: `Trainer(cfg).run()` as `hyperloom train` does, plus a probe
    after each optimizer step (state bytes, peak RSS). Rank 0 writes every rank's numbers."""
    import torch
    import torch.distributed as dist

    from hyperloom.config import load_config
    from hyperloom.parallel.footprint import local_state_bytes, saved_activations
    from hyperloom.parallel.zero1 import ZeroOneAdamW
    from hyperloom.train.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s",
    )
    cfg = load_config(None, overrides)  # world size from torchrun's WORLD_SIZE
    trainer = Trainer(cfg)
    mine: dict[str, Any] = {
        "rank": rank,
        "setup_peak_rss_bytes": machine.peak_rss_bytes(),
        "clock": [],  # per step: (time, machine busy CPU-s, this rank's CPU-s)
    }
    optimizer = trainer.optimizer
    optimizer_step = optimizer.step

    def probed_step(*a: Any, **kw: Any) -> Any:
        out = optimizer_step(*a, **kw)
        held = local_state_bytes(trainer.pm, optimizer)
        # Outside ZeRO-1 the parameters are the FP32 master weights: count them once.
        held["master"] = held["master"] if isinstance(optimizer, ZeroOneAdamW) else 0
        mine["state_bytes"] = {**held, "total": sum(held.values())}
        mine["train_peak_rss_bytes"] = machine.peak_rss_bytes()
        cpu = machine.cpu_seconds()
        mine["clock"].append((time.perf_counter(), *cpu) if cpu else None)
        return out

    optimizer.step = probed_step  # instance attribute: the trainer calls self.optimizer.step()
    if not trainer.pm.pipelined:  # the first training forward: what it saves for backward
        forward = trainer.fwd

        def counted_forward(*a: Any, **kw: Any) -> Any:
            if not torch.is_grad_enabled() or "saved_activation_bytes" in mine:
                return forward(*a, **kw)
            with saved_activations(trainer.model) as seen:
                out = forward(*a, **kw)
            mine["saved_activation_bytes"] = sum(seen.values())
            return out

        trainer.fwd = counted_forward
    summary = trainer.run().summary
    mine["end_peak_rss_bytes"] = machine.peak_rss_bytes()
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    if rank == 0:
        out_path.write_text(json.dumps({"summary": summary, "ranks": ranks}, indent=2))
    # Leave without the interpreter's teardown: 4 of about 55 two-process runs of this worker
    # aborted there after finishing ("terminate called without an active exception", gloo;
    # with or without destroy_process_group), which torchrun reports as a failed run.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- one layout


def launch(layout: Layout, overrides: list[str], out: Path, log_path: Path, threads: int) -> dict:
    """Run one layout to completion; returns its exit status, wall time and other load."""
    script = str(Path(__file__).resolve())
    cmd = [sys.executable, script, WORKER_FLAG, str(out), *overrides]
    if layout.nproc > 1:  # what `hyperloom train --nproc N` runs
        cmd = [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone"),
            f"--nproc-per-node={layout.nproc}",
            *cmd[1:],
        ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cpu0, kids0 = machine.cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with log_path.open("w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - start
    cpu1, kids1 = machine.cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    other = None
    if cpu0 and cpu1:  # every descendant was waited for, so RUSAGE_CHILDREN holds them all
        ours = (kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime) + (
            cpu1[1] - cpu0[1]
        )
        other = max(0.0, (cpu1[0] - cpu0[0]) - ours) / wall
    return {"rc": rc, "wall_s": wall, "other_cpu_cores_run": other, "command": cmd}


def steps_other_load(ranks: list[dict[str, Any]], warmup: int) -> float | None:
    """Cores other processes used during the timed steps: from the end of step `warmup` to
    the end of the last one, the machine's busy CPU minus every rank's own, over rank 0's
    wall time (the ranks' clocks line up within a step, their collectives see to that)."""
    clocks = [r["clock"] for r in ranks]
    lo = max(warmup, 1) - 1
    if any(len(c) < lo + 2 or c[lo] is None or c[-1] is None for c in clocks):
        return None
    wall = clocks[0][-1][0] - clocks[0][lo][0]
    busy = clocks[0][-1][1] - clocks[0][lo][1]
    ours = sum(c[-1][2] - c[lo][2] for c in clocks)
    return max(0.0, busy - ours) / wall if wall > 0 else None


def read_run(run_dir: Path, out: Path, warmup: int) -> dict[str, Any]:
    """Per-step losses and tokens/s from metrics.jsonl; per-rank numbers from the worker."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("event") == "train"]
    timed = [r["tokens_per_s"] for r in train if r["step"] > warmup]
    worker_out = json.loads(out.read_text())
    ranks, summary = worker_out["ranks"], worker_out["summary"]
    return {
        "steps": [r["step"] for r in train],
        "losses": [r["loss"] for r in train],
        "grad_norms": [r["grad_norm"] for r in train],
        "tokens_per_s_steps": [r["tokens_per_s"] for r in train],
        "tokens_per_s_median": statistics.median(timed) if timed else None,
        "tokens_per_s_mean": statistics.fmean(timed) if timed else None,
        "peak_rss_gb_per_rank": [r["train_peak_rss_bytes"] / GB for r in ranks],
        "setup_peak_rss_gb_per_rank": [r["setup_peak_rss_bytes"] / GB for r in ranks],
        # what training added to the built model's high-water mark, less the gradients and
        # moments it allocated: activations and transient buffers (context parallelism's
        # per-rank measure); approximate, as RSS is (freed heap pages may stay resident)
        "activation_gb_per_rank": [
            (
                r["train_peak_rss_bytes"]
                - r["setup_peak_rss_bytes"]
                - r["state_bytes"]["grads"]
                - r["state_bytes"]["optimizer"]
            )
            / GB
            for r in ranks
        ],
        "end_peak_rss_gb_per_rank": [r["end_peak_rss_bytes"] / GB for r in ranks],
        "state_mb_per_rank": [r["state_bytes"]["total"] / MB for r in ranks],
        # what the first training forward saved for backward (parameters left out)
        "saved_activation_gb_per_rank": [r.get("saved_activation_bytes", 0) / GB for r in ranks],
        "state_bytes_per_rank": [r["state_bytes"] for r in ranks],
        "other_cpu_cores_steps": steps_other_load(ranks, warmup),
        "trainer_summary": {
            k: summary.get(k)
            for k in (
                "layout",
                "device",
                "tokens_per_s",
                "peak_memory_gb",
                "peak_memory_gb_per_rank",
                "final_train_loss",
                "final_val_loss",
                "tokens_seen",
                # the planner's self-check beside the measured step and peak (rank 0)
                "predicted_step_s",
                "measured_step_s",
                "predicted_peak_memory_gb",
                "measured_peak_memory_gb",
            )
        },
    }


def run_layout(
    args: argparse.Namespace, layout: Layout, cores: int, scratch: Path
) -> dict[str, Any]:
    """One layout, retried while other processes disturb it; the least disturbed run wins."""
    threads = max(1, cores // layout.nproc)
    attempts: list[dict[str, Any]] = []
    for attempt in range(args.retries + 1):
        if args.quiet_wait > 0:
            machine.wait_for_quiet(args.quiet_wait)
        run_dir = scratch / f"{layout.name}-{attempt}"
        out = scratch / f"{layout.name}-{attempt}.json"
        log_path = scratch / f"{layout.name}-{attempt}.log"
        overrides = job_overrides(args, layout, run_dir)
        result: dict[str, Any] = {
            "attempt": attempt,
            "threads_per_process": threads,
            **launch(layout, overrides, out, log_path, threads),
        }
        lines = log_path.read_text().splitlines() if log_path.is_file() else []
        tail = "\n".join(line for line in lines[-60:] if line.strip())
        if out.is_file():  # rank 0 writes it last, once every rank's numbers are gathered
            result.update(read_run(run_dir, out, args.warmup))
            if result["rc"] != 0:  # trained and reported, then a process died on the way out
                result.update(exit_problem=tail, log=str(log_path))
        else:
            # The worker's own lines; torchrun's report of the failure follows them.
            result.update(error=tail, log=str(log_path))
        # What disturbs tokens/s is other work during the timed steps; the whole run's
        # figure (start-up included) stands in when the steps' is not available.
        steps_other = result.get("other_cpu_cores_steps")
        result["other_cpu_cores"] = (
            steps_other if steps_other is not None else result["other_cpu_cores_run"]
        )
        if not args.keep_runs and result["rc"] == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
        attempts.append(result)
        other = result["other_cpu_cores"]
        if "error" in result or other is None or other <= machine.BUSY_CORES:
            break
        if attempt < args.retries:
            print(f"    contended ({other:.2f} other cores), retrying", flush=True)
    ok = [a for a in attempts if "error" not in a]
    best = min(ok, key=lambda a: a["other_cpu_cores"] or 0.0) if ok else attempts[-1]
    other = best["other_cpu_cores"]
    return {
        **asdict(layout),
        "nproc": layout.nproc,
        "micro_batch_size": args.global_batch // layout.dp,
        **best,
        "contended": other is not None and other > machine.BUSY_CORES,
        "attempts": len(attempts),
    }


def measure(
    args: argparse.Namespace, layouts: list[Layout], cores: int, scratch: Path
) -> list[dict[str, Any]]:
    """Fill the data cache, then run every layout in turn, a progress line each."""
    prep = scratch / "prepare.log"
    with prep.open("w") as log:
        rc = subprocess.call(
            [sys.executable, __file__, PREPARE_FLAG, *job_overrides(args, LAYOUTS[0], scratch)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if rc:
        raise SystemExit(f"preparing the data failed:\n{prep.read_text()[-3000:]}")
    print(f"data cache: {args.cache_dir}")
    results = []
    for i, layout in enumerate(layouts, 1):
        procs = f"{layout.nproc} process" + ("es" if layout.nproc > 1 else "")
        print(f"[{i}/{len(layouts)}] {layout.name} ({procs}) ...", flush=True)
        r = run_layout(args, layout, cores, scratch)
        results.append(r)
        if "error" in r:
            print(f"    FAILED (exit {r['rc']}), log {r['log']}:\n" + r["error"], flush=True)
            continue
        if "exit_problem" in r:
            print(
                f"    finished and reported, then exited with status {r['rc']}: "
                f"{_exit_reason(r['exit_problem'])} (log {r['log']})",
                flush=True,
            )
        print(
            f"    {r['tokens_per_s_median']:,.0f} tokens/s, peak RSS "
            f"{_per_rank(r['peak_rss_gb_per_rank'], '.2f')} GB, state "
            f"{_per_rank(r['state_mb_per_rank'], '.0f')} MB per rank, "
            f"final loss {r['losses'][-1]:.4f} ({r['wall_s']:.0f} s)",
            flush=True,
        )
    return results


# --------------------------------------------------------------------------- report


def add_loss_diffs(results: list[dict[str, Any]]) -> None:
    """Max relative per-step loss difference of every layout from the single-process run."""
    ref = next((r for r in results if r["name"] == "single" and "losses" in r), None)
    for r in results:
        if ref is None or "losses" not in r or r is ref:
            r["loss_max_rel_diff"] = 0.0 if r is ref else None
            continue
        if r["steps"] != ref["steps"]:  # cannot happen with the same --steps; fail the check
            r["loss_max_rel_diff"] = None
            continue
        r["loss_max_rel_diff"] = max(
            abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"], strict=True)
        )


def _exit_reason(tail: str) -> str:
    """The line of a log tail that says why a process ended badly."""
    for marker in ("terminate called", "Signal ", "Error"):
        for line in tail.splitlines():
            if marker in line:
                return line.strip()
    return "see the log"


def _per_rank(values: list[float] | None, fmt: str) -> str:
    return "-" if not values else " / ".join(format(v, fmt) for v in values)


def print_table(results: list[dict[str, Any]], args: argparse.Namespace, cores: int) -> None:
    from rich.console import Console
    from rich.table import Table

    single = next((r for r in results if r["name"] == "single" and "error" not in r), None)
    ref_tps = single["tokens_per_s_median"] if single else None
    table = Table(
        title=f"parallel layouts: tiny Llama, {args.global_batch} x {args.seq_len} tokens/step "
        f"(global), {args.dtype}, {args.steps} steps, {cores} CPU cores"
    )
    table.add_column("layout")
    for col in ("procs", "threads/proc", "tokens/s", "vs single", "peak RSS GB/rank"):
        table.add_column(col, justify="right")
    for col in ("saved act GB/rank", "RSS act GB/rank", "state MB/rank"):
        table.add_column(col, justify="right")
    for col in ("loss max rel diff", "other load"):
        table.add_column(col, justify="right")
    for r in results:
        if "error" in r:
            table.add_row(r["name"], str(r["nproc"]), str(r["threads_per_process"]), "FAILED")
            continue
        tps = r["tokens_per_s_median"]
        diff = r["loss_max_rel_diff"]
        other = r["other_cpu_cores"]
        table.add_row(
            r["name"] + (" *" if "exit_problem" in r else ""),
            str(r["nproc"]),
            str(r["threads_per_process"]),
            f"{tps:,.0f}",
            f"{tps / ref_tps:.2f}x" if ref_tps else "-",
            _per_rank(r["peak_rss_gb_per_rank"], ".2f"),
            _per_rank(r["saved_activation_gb_per_rank"], ".3f"),
            _per_rank(r["activation_gb_per_rank"], ".2f"),
            _per_rank(r["state_mb_per_rank"], ".0f"),
            "ref" if r is single else ("-" if diff is None else f"{diff:.1e}"),
            ("-" if other is None else f"{other:.2f} cores") + (" !" if r["contended"] else ""),
        )
    console = Console() if sys.stdout.isatty() else Console(width=170)
    console.print(table)
    console.print(
        f"tokens/s: median of steps {args.warmup + 1}..{args.steps}; peak RSS: each process's "
        "high-water mark at its last optimizer step (interpreter, torch and data included); "
        "saved act: bytes the first training forward saved for backward (parameters left out); "
        "RSS act: the peak less the one after set-up, less gradients and moments; "
        "state: params + grads + Adam moments (+ ZeRO-1 master slice) held by the rank; loss "
        "diff: vs single, per step; other load: CPU other processes used during the timed steps "
        "(! = contended)"
        + (
            "; * = trained and reported, then a process ended abnormally at exit"
            if any("exit_problem" in r for r in results)
            else ""
        )
    )


def verdict(results: list[dict[str, Any]], args: argparse.Namespace, cores: int) -> list[str]:
    """The closing summary lines; the first says whether the benchmark passed."""
    failed = [r["name"] for r in results if "error" in r]
    diffs = {r["name"]: r["loss_max_rel_diff"] for r in results if "error" not in r}
    lines = []
    if args.dtype == "fp32":
        bad = [n for n, d in diffs.items() if d is None or d > LOSS_RTOL]
        lines.append(
            f"loss parity (fp32, rtol {LOSS_RTOL:g}): "
            + ("ok for every layout" if not bad else f"FAILED for {', '.join(bad)}")
        )
    else:
        worst = max((d for d in diffs.values() if d is not None), default=0.0)
        lines.append(
            f"loss diff (bf16, reported only): at most {worst:.1e} relative; "
            "run --dtype fp32 for the 1e-5 check"
        )
    if failed:
        lines.append(f"runs FAILED: {', '.join(failed)} (log tails are in the JSON)")
    for r in results:
        if "exit_problem" in r:
            lines.append(
                f"{r['name']}: finished and reported, then exited with status {r['rc']} "
                f"({_exit_reason(r['exit_problem'])}); its numbers are kept, the log is in the JSON"
            )
    ok = [r for r in results if "error" not in r]
    if ok:
        fastest = max(ok, key=lambda r: r["tokens_per_s_median"])
        least = min(max(r["state_mb_per_rank"]) for r in ok)
        leanest = [r["name"] for r in ok if max(r["state_mb_per_rank"]) <= 1.01 * least]
        lines.append(
            f"fastest: {fastest['name']} ({fastest['tokens_per_s_median']:,.0f} tokens/s); "
            f"least state per rank: {', '.join(leanest)} ({least:.0f} MB)"
        )
    if any(r["nproc"] > cores for r in results):
        lines.append(
            f"note: this machine has {cores} CPU cores; layouts with more processes than cores "
            "measure oversubscription, not scaling"
        )
    else:
        lines.append(
            f"note: {cores} CPU cores are shared by all processes of a layout, so splitting the "
            "step across processes cannot make it faster here; tokens/s shows the overhead"
        )
    busy = [r["name"] for r in ok if r["contended"]]
    if busy:
        lines.append(f"contended (other processes were busy): {', '.join(busy)}")
    return lines


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--steps", type=int, default=6, help="training steps per layout")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--corpus-mb", type=float, default=4.0, help="data.max_corpus_mb")
    p.add_argument(
        "--world", type=int, default=2, help="largest number of processes (4 adds dp4, dp2 x tp2)"
    )
    p.add_argument("--only", help="comma list of layouts (default: all up to --world)")
    p.add_argument("--retries", type=int, default=2, help="re-runs of a contended layout")
    p.add_argument(
        "--quiet-wait", type=float, default=30, help="seconds to wait for a quiet machine per run"
    )
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="HYPERLOOM_CACHE")
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories and logs")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    return p.parse_args(argv)


def select_layouts(args: argparse.Namespace) -> list[Layout]:
    by_name = {layout.name: layout for layout in LAYOUTS}
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise SystemExit(f"--only: unknown {unknown}; layouts are {', '.join(by_name)}")
        chosen = [by_name[n] for n in names]
        if "single" not in names:  # the reference for 'vs single' and the loss check
            chosen.insert(0, by_name["single"])
    else:
        chosen = [layout for layout in LAYOUTS if layout.nproc <= args.world]
    for layout in chosen:
        if args.global_batch % layout.dp:
            raise SystemExit(
                f"--global-batch {args.global_batch} does not split over dp {layout.dp} "
                f"({layout.name}): {args.global_batch} / {layout.dp} = "
                f"{args.global_batch / layout.dp:g} sequences per rank"
            )
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` cleans up
    if args.steps <= args.warmup or args.warmup < 0 or args.retries < 0:
        raise SystemExit("need --steps > --warmup >= 0 and --retries >= 0")
    layouts = select_layouts(args)
    cores = cpu_cores()
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["HYPERLOOM_CACHE"] = str(args.cache_dir)
    info = machine.machine_info(cores, "cpu")
    print(
        f"machine: {info.get('cpu_model')}, {cores} CPU cores, torch {info['torch']}; "
        f"{len(layouts)} layouts, {args.dtype}, {args.global_batch} x {args.seq_len} tokens/step"
    )
    if any(layout.nproc > cores for layout in layouts):
        print(
            f"note: {cores} cores; layouts with more processes than that measure "
            "oversubscription, not scaling"
        )

    wall = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="hyperloom-layouts-"))
    keep = args.keep_runs
    try:
        results = measure(args, layouts, cores, scratch)
        keep = keep or any(r["rc"] != 0 for r in results)
    finally:  # also on Ctrl-C; a failed run's logs stay for reading
        if keep:
            print(f"run directories and logs: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    add_loss_diffs(results)
    print_table(results, args, cores)
    lines = verdict(results, args, cores)
    for line in lines:
        print(line)

    elapsed = time.perf_counter() - wall
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "parallel_layouts",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {**info, "cpu_cores": cores},
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": "tiny",
            "tokens_per_step": args.global_batch * args.seq_len,
            "loss_rtol_fp32": LOSS_RTOL,
            "busy_cores": machine.BUSY_CORES,
            "overrides_single": job_overrides(args, layouts[0], Path("RUN_DIR")),
        },
        "layouts": results,
        "summary": lines,
        "wall_time_s": elapsed,
    }
    machine.write_results(args.json, payload)
    print(f"wrote {args.json} ({elapsed:.0f} s)")
    failed = any("error" in r for r in results)
    parity_failed = args.dtype == "fp32" and any(
        r.get("loss_max_rel_diff") is None or r["loss_max_rel_diff"] > LOSS_RTOL
        for r in results
        if "error" not in r
    )
    return 1 if failed or parity_failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER_FLAG]:
        worker(Path(sys.argv[2]), sys.argv[3:])  # leaves through os._exit
    if sys.argv[1:2] == [PREPARE_FLAG]:
        sys.exit(prepare_data(sys.argv[2:]))
    sys.exit(main())
