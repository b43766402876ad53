"""The quickstart job, measured: `hyperloom train configs/quickstart.toml` as
`scripts/quickstart.sh` runs it, on an empty data and planner cache (a first run on a new
machine: the tokenizer is trained, the corpus tokenized and the planner calibrated), timed
from start to exit. Prints the held-out loss in nats per token and bits per byte, the time
spent outside training, the sample, and the planner's self-check; writes them to JSON.

    python benchmarks/quickstart.py --json benchmarks/results/quickstart.json
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import machine

ROOT = Path(__file__).resolve().parent.parent
KEYS = (
    "steps", "tokens_seen", "tokens_per_s", "initial_val_loss", "final_val_loss",
    "initial_val_bpb", "final_val_bpb", "wall_time_s", "peak_memory_gb",
    "peak_memory_measures", "predicted_step_s", "measured_step_s", "step_time_error",
    "predicted_peak_memory_gb", "measured_peak_memory_gb", "memory_error", "sample",
)  # fmt: skip


def run_once(work: Path, seed: int, cold: bool, extra: list[str]) -> dict:
    wall, summary, output, busy = machine.timed_train(
        ROOT / "configs" / "quickstart.toml",
        work / f"run{seed}",
        ["--train.seed", str(seed), *extra],
        work / f"cache{seed}" if cold else None,
    )
    return {
        "seed": seed,
        "command_wall_s": wall,
        "outside_training_s": wall - summary["wall_time_s"],
        "machine_busy_cores": busy,
        "calibrated_the_planner": "calibrating this machine once" in output,
        **{k: summary.get(k) for k in KEYS},
    }


def _signed(error: float | None) -> str:
    return "-" if error is None else f"{error:+.0%}"


def table(runs: list[dict]) -> str:
    head = ["seed", "command s", "training s", "tokens/s", "val loss", "val bits/byte",
            "planner step", "planner memory"]  # fmt: skip
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in runs:
        lines.append(" | ".join([
            str(r["seed"]), f"{r['command_wall_s']:.0f}", f"{r['wall_time_s']:.0f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['initial_val_loss']:.2f} -> {r['final_val_loss']:.3f}",
            f"{r['initial_val_bpb']:.2f} -> {r['final_val_bpb']:.3f}",
            _signed(r.get("step_time_error")), _signed(r.get("memory_error")),
        ]))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = machine.train_runs_parser(__doc__, "1234")
    ap.add_argument("--warm-cache", action="store_true", help="reuse this machine's caches")
    args = ap.parse_args()
    waited = machine.wait_for_quiet()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            runs.append(run_once(Path(tmp), seed, not args.warm_cache, args.extra))
            r = runs[-1]
            print(f"seed {seed}: {r['command_wall_s']:.0f} s, "
                  f"{r['final_val_bpb']:.3f} bits per byte", flush=True)  # fmt: skip
    if args.json:
        machine.write_results(args.json, {
            "benchmark": "quickstart",
            "command": "hyperloom train configs/quickstart.toml",
            "machine": machine.machine_info(0, "cpu"),
            "waited_for_quiet_s": waited,
            "cold_cache": not args.warm_cache,
            "runs": runs,
        })  # fmt: skip
    print(table(runs))
    print(f"\nsample (seed {runs[0]['seed']}):\n{runs[0]['sample']}")


if __name__ == "__main__":
    main()
