"""The planner against measurements on this machine: predicted vs measured step time and
peak memory for tp / pp / dp / cp / schedule mixes of the default model on 1-4 processes.

Each configuration is a real `hyperloom train --nproc N` run whose self-check
(`hyperloom.planner.selfcheck`) puts the planner's prediction, made with one profile of this
machine measured at the start (`plan calibrate`), beside the measured mean step time and
peak memory above the pre-model baseline; this script collects them, prints a table and writes
`results/planner_validation.json`. Targets (issue 9): step time within 15%, memory within 10%.

    python benchmarks/planner_validation.py [--steps 12] [--only single,pp2-1f1b] [--no-wait]

Timing needs a quiet machine: the script waits for other processes to settle before each run
(`machine.wait_for_quiet`) and records how busy the machine was. Memory does not: `--no-wait`
skips the waiting (for a memory-only check on a busy machine; its step times are not valid).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent
# (name, processes, overrides): global batch 8 x 256 tokens everywhere.
CONFIGS: list[tuple[str, int, list[str]]] = [
    ("single", 1, ["--train.micro_batch_size", "8"]),
    ("dp2", 2, ["--parallel.dp", "2", "--train.micro_batch_size", "4"]),
    ("dp2-zero1", 2, ["--parallel.dp", "2", "--parallel.zero", "1", "--train.micro_batch_size", "4"]),
    ("tp2", 2, ["--parallel.tp", "2", "--train.micro_batch_size", "8"]),
    ("tp2-sp", 2, ["--parallel.tp", "2", "--parallel.sp", "true", "--train.micro_batch_size", "8"]),
    ("pp2-1f1b", 2, ["--parallel.pp", "2", "--train.micro_batch_size", "2", "--parallel.microbatches", "4"]),
    ("pp2-gpipe", 2, ["--parallel.pp", "2", "--parallel.pp_schedule", "gpipe", "--train.micro_batch_size", "2", "--parallel.microbatches", "4"]),
    ("pp2-zb-h1", 2, ["--parallel.pp", "2", "--parallel.pp_schedule", "zb-h1", "--train.micro_batch_size", "2", "--parallel.microbatches", "4"]),
    ("pp2-interleaved", 2, ["--parallel.pp", "2", "--parallel.pp_schedule", "interleaved", "--parallel.vpp", "2", "--train.micro_batch_size", "2", "--parallel.microbatches", "4"]),
    ("pp2-dualpipe", 2, ["--parallel.pp", "2", "--parallel.pp_schedule", "dualpipe", "--train.micro_batch_size", "2", "--parallel.microbatches", "4"]),
    ("tp2-dp2", 4, ["--parallel.tp", "2", "--parallel.dp", "2", "--train.micro_batch_size", "4"]),
    ("pp2-dp2", 4, ["--parallel.pp", "2", "--parallel.dp", "2", "--train.micro_batch_size", "2", "--parallel.microbatches", "2"]),
    ("cp2-ring", 2, ["--parallel.cp", "2", "--train.micro_batch_size", "8"]),
    ("cp2-alltoall", 2, ["--parallel.cp", "2", "--parallel.cp_comm", "alltoall", "--train.micro_batch_size", "8"]),
    ("cp2-dp2", 4, ["--parallel.cp", "2", "--parallel.dp", "2", "--train.micro_batch_size", "4"]),
]  # fmt: skip


def calibrate(out: Path, dtype: str = "bf16") -> Path:
    cmd = [sys.executable, "-m", "hyperloom", "plan", "calibrate", "--out", str(out)]
    cmd += ["--dtype", dtype]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def run_config(name: str, nproc: int, extra: list[str], profile: Path, steps: int, tmp: Path):
    run_dir = tmp / name
    cmd = [
        sys.executable, "-m", "hyperloom", "train", "--nproc", str(nproc), "configs/tiny.toml",
        "--run-dir", str(run_dir), "--train.steps", str(steps), "--train.warmup_steps", "2",
        "--train.eval_every", "0", "--train.eval_batches", "1", "--checkpoint.every", "0",
        "--logging.sample_tokens", "0", "--logging.progress", "false", "--logging.plot", "false",
        "--logging.self_check", str(profile), "--logging.log_every", "1", *extra,
    ]  # fmt: skip
    busy_before = machine.cpu_seconds()
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent)
    wall = time.perf_counter() - start
    busy_after = machine.cpu_seconds()
    if result.returncode != 0:
        return {"name": name, "error": result.stderr[-2000:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    # The first step pays allocation and warm-up: time the rest from the per-step metrics.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_s = [r["tokens_per_s"] for r in rows if r.get("event") == "train"][1:]
    tokens = summary["tokens_seen"] / summary["steps"]
    steady = sum(tokens / t for t in steps_s) / len(steps_s) if steps_s else None
    out = {
        "name": name,
        "processes": nproc,
        "overrides": extra,
        "wall_s": wall,
        "measured_step_s": steady,
        "measured_step_s_with_first": summary.get("measured_step_s"),
        "predicted_step_s": summary.get("predicted_step_s"),
        "measured_peak_memory_gb": summary.get("measured_peak_memory_gb"),
        "predicted_peak_memory_gb": summary.get("predicted_peak_memory_gb"),
        "predicted_live_memory_gb": summary.get("predicted_live_memory_gb"),
        "host_alloc_factor": summary.get("plan_host_alloc_factor"),
        "host_runtime_gb": summary.get("plan_host_runtime_gb"),
        "host_churn_factor": summary.get("plan_host_churn_factor"),
        "compute_share": summary.get("plan_compute_share"),
        "plan_error": summary.get("plan_error"),
        "predicted_memory_gib_by_part": summary.get("predicted_memory_gib_by_part"),
        "final_train_loss": summary.get("final_train_loss"),
    }
    if steady and out["predicted_step_s"]:
        out["step_time_error"] = out["predicted_step_s"] / steady - 1
    if out["measured_peak_memory_gb"] and out["predicted_peak_memory_gb"]:
        out["memory_error"] = out["predicted_peak_memory_gb"] / out["measured_peak_memory_gb"] - 1
    if busy_before and busy_after:
        out["machine_busy_cores"] = (busy_after[0] - busy_before[0]) / wall
    return out


def add_fitted(results: list[dict]) -> float | None:
    """One runtime efficiency fitted on the single-process run (as `--efficiency` does for
    Megatron's table in docs/planner.md), and every other run's step-time error with it."""
    single = next(
        (r for r in results if r.get("name") == "single" and "step_time_error" in r), None
    )
    if single is None:
        return None
    eff = single["predicted_step_s"] / single["measured_step_s"]
    for r in results:
        if "step_time_error" in r:
            r["step_time_error_fitted"] = r["predicted_step_s"] / eff / r["measured_step_s"] - 1
    return eff


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--only", default="", help="comma-separated config names")
    p.add_argument("--profile", default="", help="a `plan calibrate` JSON (default: measure)")
    p.add_argument("--out", default=str(HERE / "results" / "planner_validation.json"))
    p.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    args = p.parse_args(argv)
    console = Console()
    chosen = [c for c in CONFIGS if not args.only or c[0] in args.only.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if not args.no_wait:
            machine.wait_for_quiet()
        profile = Path(args.profile) if args.profile else calibrate(tmp / "profile.json")
        console.print(f"profile: {profile}")
        for i, (name, nproc, extra) in enumerate(chosen, 1):
            if not args.no_wait:
                machine.wait_for_quiet()
            console.print(f"[{i}/{len(chosen)}] {name} on {nproc} process(es) ...")
            results.append(run_config(name, nproc, extra, profile, args.steps, tmp))
        profile_data = json.loads(profile.read_text())

    eff = add_fitted(results)
    table = Table(title="planner vs this machine (default model, bf16, 8 x 256 tokens per step)")
    for col in ("config", "procs", "step pred s", "step meas s", "err", "err, fitted",
                "mem pred GB", "mem meas GB", "err", "busy cores"):  # fmt: skip
        table.add_column(col, justify="right")
    ok_t = ok_m = 0
    for r in results:
        if "error" in r or r.get("plan_error"):
            table.add_row(r["name"], "-", r.get("plan_error") or "run failed", *[""] * 7)
            continue
        et, em = r.get("step_time_error"), r.get("memory_error")
        ok_t += et is not None and abs(et) <= 0.15
        ok_m += em is not None and abs(em) <= 0.10
        table.add_row(
            r["name"],
            str(r["processes"]),
            f"{r['predicted_step_s']:.3f}",
            f"{r['measured_step_s']:.3f}",
            f"{et:+.1%}" if et is not None else "-",
            f"{r['step_time_error_fitted']:+.1%}" if "step_time_error_fitted" in r else "-",
            f"{r['predicted_peak_memory_gb']:.3f}",
            f"{r['measured_peak_memory_gb']:.3f}",
            f"{em:+.1%}" if em is not None else "-",
            f"{r.get('machine_busy_cores', float('nan')):.2f}",
        )
    console.print(table)
    fitted_ok = sum(abs(r.get("step_time_error_fitted", 1)) <= 0.15 for r in results) - 1
    console.print(
        f"step time within 15%: {ok_t}/{len(results)}; memory within 10%: {ok_m}/{len(results)}"
        + (
            f"; with one efficiency ({eff:.3f}) fitted on `single`: {fitted_ok}/"
            f"{len(results) - 1} of the others within 15%"
            if eff
            else ""
        )
    )
    record = {
        "machine": machine.machine_info(0, "cpu"),
        "revision": machine.hyperloom_revision(),
        "profile": profile_data,
        "steps": args.steps,
        "waited_for_quiet": not args.no_wait,
        "results": results,
        "within_targets": {"step_time_15pct": ok_t, "memory_10pct": ok_m, "of": len(results)},
        "fitted_efficiency": eff,
    }
    machine.write_results(args.out, record)
    console.print(f"wrote {args.out}")
    for r in results:
        if "error" in r:
            console.print(f"[red]{r['name']} failed[/red]:\n{r['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
