"""The vision-language quickstart, measured: `hyperloom train configs/vlm-tiny.toml`.

Runs the command as a user would (a subprocess, a fresh run directory, the data cache warm
or not as `--cold-cache` says), timed from start to exit, once per seed. Prints the held-out
accuracy by task beside chance, the losses and the time, and writes them to JSON with the
run's `vlm_eval.png` copied beside it.

    python benchmarks/vlm_tiny.py --json benchmarks/results/vlm_tiny.json
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import machine

ROOT = Path(__file__).resolve().parent.parent


def run_once(seed: int, work: Path, cold_cache: bool, extra: list[str]) -> dict:
    run_dir = work / f"seed{seed}"
    wall, summary, output, busy = machine.timed_train(
        ROOT / "configs" / "vlm-tiny.toml",
        run_dir,
        ["--train.seed", str(seed), *extra],
        work / f"cache{seed}" if cold_cache else None,
    )
    return {
        "seed": seed,
        "command_wall_s": wall,
        "train_wall_s": summary["wall_time_s"],
        "machine_busy_cores": busy,
        "steps": summary["steps"],
        "tokens_per_s": summary["tokens_per_s"],
        "initial_val_loss": summary["initial_val_loss"],
        "final_val_loss": summary["final_val_loss"],
        "vlm_eval": summary["vlm_eval"],
        "skipped_updates": output.count("skip: dropped the update"),
        "run_dir": run_dir,
    }


def table(runs: list[dict]) -> str:
    tasks = sorted(runs[0]["vlm_eval"]["by_task"])
    head = ["seed", "wall s", "val loss", "accuracy", "chance", *tasks]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in runs:
        ev = r["vlm_eval"]
        cells = [str(r["seed"]), f"{r['command_wall_s']:.0f}",
                 f"{r['initial_val_loss']:.2f} -> {r['final_val_loss']:.3f}",
                 f"{ev['accuracy']:.1%}", f"{ev['chance']:.1%}"]  # fmt: skip
        cells += [f"{ev['by_task'][t]['accuracy']:.0%}" for t in tasks]
        lines.append(" | ".join(cells))
    chance = runs[0]["vlm_eval"]["by_task"]
    lines.append(
        " | ".join(["chance", "", "", "", ""] + [f"{chance[t]['chance']:.0%}" for t in tasks])
    )
    return "\n".join(lines)


def main() -> None:
    ap = machine.train_runs_parser(__doc__, "0")
    ap.add_argument("--cold-cache", action="store_true", help="a fresh data cache per run")
    args = ap.parse_args()
    waited = machine.wait_for_quiet()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            runs.append(run_once(seed, Path(tmp), args.cold_cache, args.extra))
            print(f"seed {seed}: {runs[-1]['command_wall_s']:.0f} s, "
                  f"accuracy {runs[-1]['vlm_eval']['accuracy']:.1%}", flush=True)  # fmt: skip
        if args.json:
            plot = args.json.with_suffix(".png")
            shutil.copy(runs[0]["run_dir"] / "vlm_eval.png", plot)
            for r in runs:
                r.pop("run_dir")
            machine.write_results(args.json, {
                "benchmark": "vlm_tiny",
                "command": "hyperloom train configs/vlm-tiny.toml",
                "machine": machine.machine_info(0, "cpu"),
                "waited_for_quiet_s": waited,
                "cold_cache": args.cold_cache,
                "runs": runs,
            })  # fmt: skip
        else:
            for r in runs:
                r.pop("run_dir")
    print(table(runs))


if __name__ == "__main__":
    main()
