"""FP8 convergence: the default model trained with BF16 and with each FP8 recipe, same everything.

Each recipe is one `hyperloom train` run (a subprocess) of the default job -- the `tiny` Llama
on the built-in corpus (Python's standard library, the built-in 16k tokenizer) -- with the same
seed, so the same initial weights, the same batches in the same order and the same fixed
validation batches. Only `precision.fp8` changes; the baseline `bf16` is `precision.fp8 = "none"`
with `precision.dtype = "bf16"` (the FP8 runs also keep BF16 autocast for what stays out of FP8:
embedding, output head, norms, attention core). Validation runs every `--eval-every` steps.

The issue's target: the final validation loss of `blockwise` and `current` within 0.5% of BF16
(DeepSeek-V3 reports < 0.25% at scale). The table gives each recipe's final validation loss and
its relative difference from BF16, the mean train loss over the last 10% of steps (`train@end`, a
second reading less tied to the fixed validation batches) and its difference, tokens/s and wall
time; the JSON holds the curves; the plot shows train loss (smoothed) and validation loss per
recipe, and the relative difference from BF16. `fp32` in `--recipes` adds a control run (FP32
compute, no autocast): how far BF16 itself lands from FP32.

FP8 on a CPU is emulated or goes through `torch._scaled_mm`'s CPU path, which is much slower than
BF16 (blockwise and MXFP8 most of all: their GEMMs are chunked along K), so on a small machine
`--micro-batch` / `--seq-len` can shrink the tokens per step; the model stays the default one.
The JSON and the table say which batch was used.

`--qk-norm` runs every contender with `model.qk_norm = true` (an RMSNorm on each query and
key head before RoPE): the default model otherwise, and a separate run root, since it is another
model. It keeps the attention logits from growing, the FP8 gap's source at this scale
(`fp8_gradient_fidelity.py`); the JSON's `model` says `tiny+qk_norm`.

The training guard (`resilience.on_anomaly`) is off by default here (`--on-anomaly none`):
at a few hundred tokens per step the gradient norm passes its 6-sigma spike threshold every
~50-100 steps, and a skipped update is a difference between runs that has nothing to do with
the arithmetic. With the trainer's default (`skip`), the 1000-step runs of seed 1234 dropped
7 (delayed) to 29 (bf16-refops) updates each, at different steps per recipe. The JSON counts
each run's skipped updates.

The learning-rate schedule is the default job's stretched to `--steps`: the job warms up over
30 of its 300 steps, so 1000 steps warm up over 100 (cosine decay already spans `--steps`).
`--warmup-steps` / `--lr` override the warmup and the peak (3e-3) for every contender alike.
Until 2026-12-01 the benchmark kept the job's 30 steps, and that made it unable to resolve its
own target: two BF16 runs of one seed that round a few operations differently can part near
step 20 -- the loss jumps in one of them while the learning rate climbs past 2e-3 -- and keep
that offset (2.8% at step 1000 for seed 4321), so one end point said little about the
arithmetic. With the 100-step warmup that seed's BF16 pair tracked through the warmup and ended
0.58% apart, and BF16 itself ended 2.9% lower. `--warmup-steps 30` repeats the older runs; the
JSON records the schedule, and `--combine` refuses to mix schedules. `--stop-at N` stops every
run at step N (`train.stop_at_step`: the schedule still plans `--steps`), and a later call without
it continues them: a short look at whether two runs track each other, extended only if they do.

Runs go to `--run-root/<recipe>`. A run that finished `--steps` is reused, not rerun; one that
stopped part way resumes from its newest checkpoint (saved every `--checkpoint-every` steps), so a
long benchmark can be continued. `--collect` only gathers what the run dirs hold.

    python benchmarks/fp8_convergence.py                                  # all six, 1000 steps
    python benchmarks/fp8_convergence.py --recipes bf16,current,blockwise --parallel 2 --threads 1
    python benchmarks/fp8_convergence.py --micro-batch 2 --seq-len 128    # fewer tokens per step
    python benchmarks/fp8_convergence.py --collect                        # table + plot from run dirs
    python benchmarks/fp8_convergence.py --combine s1.json s2.json --json seeds.json  # over seeds

`--combine` reads the JSONs of runs that differ only in `--seed` and gives, per recipe, each
seed's final validation loss and difference from that seed's BF16, their mean, and the
difference of the mean losses: one seed's end point is a draw from a spread that the seeds
show.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hyperloom.config import PrecisionConfig
from hyperloom.resilience.events import read_jsonl

RESULTS = Path(__file__).resolve().parent / "results"
RECIPES = ("bf16", "blockwise", "current", "delayed", "rowwise", "mxfp8")
JUDGED = ("blockwise", "current")
# Optional controls. fp32: FP32 compute, no autocast -- is BF16 itself off from FP32?
# bf16-refops: BF16 with the reference operators, the same arithmetic rounded at other points
# (e.g. SwiGLU's product in BF16 instead of FP32): how far a run drifts from BF16 by rounding
# alone, the noise floor of the comparison. (Two threads instead of one is no such control:
# on CPU it reproduced the BF16 run bit for bit over 350 steps.)
# blockwise-fwd / blockwise-bwd: blockwise with only the forward GEMM, or only the two backward
# GEMMs, in FP8 (`precision.fp8_high_precision`): which side of the step a gap comes from.
# blockwise-ends: blockwise with the first and the last block in BF16 (Megatron's
# --first-last-layers-bf16 at its default of one each; `precision.fp8_bf16_*_layers`).
# blockwise-qk: blockwise with the attention query and key projections in BF16 (added to
# `precision.fp8_keep`), the linears whose FP8 gradient error is largest
# (`fp8_gradient_fidelity.py`); current-qk: the same for current scaling.
CONTROLS = ("fp32", "bf16-refops", "blockwise-fwd", "blockwise-bwd", "blockwise-ends",
            "blockwise-qk", "current-qk")  # fmt: skip
SPLIT_CONTROLS = {"blockwise-fwd": ["dgrad", "wgrad"], "blockwise-bwd": ["fprop"]}
END_CONTROLS = {"blockwise-ends": 1}
KEEP_CONTROLS = {"blockwise-qk": ["*.wq", "*.wk"], "current-qk": ["*.wq", "*.wk"]}
BF16_REPEATS = ("bf16-refops",)
BENCH_FILE = "bench.json"  # what this benchmark asked of the run, and the wall time it took


def fp8_of(recipe: str) -> str:
    """`precision.fp8` of a contender: the recipe itself, its split controls' recipe, or none."""
    if any(recipe in table for table in (SPLIT_CONTROLS, END_CONTROLS, KEEP_CONTROLS)):
        return recipe.split("-")[0]
    return recipe if recipe in RECIPES[1:] else "none"


def train_command(recipe: str, run_dir: Path, args: argparse.Namespace) -> list[str]:
    """The `hyperloom train` command line of one recipe; everything but fp8 is shared."""
    cmd = [
        sys.executable, "-m", "hyperloom", "train",
        "--run-dir", str(run_dir),
        "--precision.dtype", "fp32" if recipe == "fp32" else "bf16",
        "--precision.fp8", fp8_of(recipe),
        "--train.steps", str(args.steps),
        "--train.seed", str(args.seed),
        "--train.eval_every", str(args.eval_every),
        "--train.eval_batches", str(args.eval_batches),
        "--checkpoint.every", str(args.checkpoint_every),
        "--checkpoint.resume", "auto",
        "--logging.log_every", str(args.log_every),
        "--logging.progress", "false",
        "--logging.plot", "false",
        "--logging.sample_prompt", "",
        "--logging.self_check", "off",
        "--resilience.on_anomaly", args.on_anomaly,
    ]  # fmt: skip
    if recipe == "bf16-refops":
        cmd += ["--ops.fused", "false"]
    if recipe in SPLIT_CONTROLS:
        cmd += ["--precision.fp8_high_precision", json.dumps(SPLIT_CONTROLS[recipe])]
    if recipe in END_CONTROLS:
        n = str(END_CONTROLS[recipe])
        cmd += ["--precision.fp8_bf16_first_layers", n, "--precision.fp8_bf16_last_layers", n]
    if recipe in KEEP_CONTROLS:
        keep = [*PrecisionConfig().fp8_keep, *KEEP_CONTROLS[recipe]]
        cmd += ["--precision.fp8_keep", json.dumps(keep)]
    if args.qk_norm:
        cmd += ["--model.qk_norm", "true"]
    if args.micro_batch:
        cmd += ["--train.micro_batch_size", str(args.micro_batch)]
    if args.seq_len:
        cmd += ["--data.seq_len", str(args.seq_len)]
    cmd += ["--train.warmup_steps", str(warmup_steps(args))]
    if args.lr is not None:
        cmd += ["--train.lr", str(args.lr)]
    if args.stop_at:
        cmd += ["--train.stop_at_step", str(args.stop_at)]
    return cmd


def warmup_steps(args: argparse.Namespace) -> int:
    """`--warmup-steps`, or the default job's warmup stretched to `--steps` (module docstring):
    the job warms up over 30 of its 300 steps, so 1000 steps warm up over 100."""
    if args.warmup_steps is not None:
        return args.warmup_steps
    from hyperloom.config import JobConfig

    train = JobConfig().train
    return round(train.warmup_steps * args.steps / train.steps)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What makes two runs of one recipe the same run (a finished one is reused only if equal)."""
    keys = ("steps", "seed", "eval_every", "eval_batches", "micro_batch", "seq_len", "on_anomaly")
    out = {k: getattr(args, k) for k in keys}
    if args.qk_norm:  # only when set, so run dirs from before the flag existed stay reusable
        out["qk_norm"] = True
    out["warmup_steps"] = warmup_steps(args)
    if args.lr is not None:  # likewise; --stop-at is no setting: a run goes on
        out["lr"] = args.lr
    return out


def finished(run_dir: Path, args: argparse.Namespace) -> bool:
    bench, summary = run_dir / BENCH_FILE, run_dir / "summary.json"
    if not (bench.exists() and summary.exists()):
        return False
    same = json.loads(bench.read_text()).get("settings") == settings(args)
    return same and json.loads(summary.read_text()).get("steps") == args.steps


def launch(recipe: str, args: argparse.Namespace) -> tuple[subprocess.Popen, float]:
    run_dir = args.run_root / recipe
    run_dir.mkdir(parents=True, exist_ok=True)
    bench = run_dir / BENCH_FILE
    if bench.exists() and json.loads(bench.read_text()).get("settings") != settings(args):
        raise SystemExit(f"{run_dir} holds a run with other settings; pick another --run-root")
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op threads in the child
    log = (run_dir / "train.log").open("a")
    proc = subprocess.Popen(
        train_command(recipe, run_dir, args), stdout=log, stderr=subprocess.STDOUT, env=env
    )
    print(f"started {recipe:<10} pid {proc.pid} -> {run_dir}", flush=True)
    return proc, time.perf_counter()


def record_wall(recipe: str, args: argparse.Namespace, seconds: float, rc: int) -> None:
    """Add this launch's wall time to the run's total (a resumed run has several launches)."""
    bench = args.run_root / recipe / BENCH_FILE
    old = json.loads(bench.read_text()) if bench.exists() else {}
    launches = old.get("launches", []) + [{"wall_s": seconds, "returncode": rc}]
    cmd = train_command(recipe, args.run_root / recipe, args)
    out = {"settings": settings(args), "command": cmd[1:], "launches": launches}
    bench.write_text(json.dumps(out, indent=1))


def run_all(recipes: list[str], args: argparse.Namespace) -> None:
    """Up to `--parallel` runs at a time, in the order given (put the longest first)."""
    todo = [r for r in recipes if not finished(args.run_root / r, args)]
    for r in recipes:
        if r not in todo:
            print(f"reusing {r:<10} (finished {args.steps} steps in {args.run_root / r})")
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    while todo or running:
        while todo and len(running) < args.parallel:
            recipe = todo.pop(0)
            running[recipe] = launch(recipe, args)
        time.sleep(5)
        for recipe, (proc, t0) in list(running.items()):
            if proc.poll() is not None:
                del running[recipe]
                record_wall(recipe, args, time.perf_counter() - t0, proc.returncode)
                print(f"finished {recipe:<10} rc {proc.returncode}", flush=True)


def collect(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """Curves and summary of one run dir (None if it has no metrics yet)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    tps: list[float] = []
    skipped: set[int] = set()
    for rec in read_jsonl(metrics):  # a run still writing (or killed) may end mid-line
        if rec.get("event") == "skip":
            skipped.add(rec["step"])
        elif rec.get("event") == "train":
            train[rec["step"]] = rec["loss"]  # a resumed run rewrites steps; the last one wins
            tps.append(rec["tokens_per_s"])
        elif rec.get("event") == "eval":
            val[rec["step"]] = rec["val_loss"]
    summary_path, bench_path = run_dir / "summary.json", run_dir / BENCH_FILE
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    bench = json.loads(bench_path.read_text()) if bench_path.exists() else {}
    log = run_dir / "train.log"
    fp8_line = next(
        (ln.split("INFO", 1)[-1].strip() for ln in log.read_text().splitlines() if "FP8 (" in ln),
        None,
    ) if log.exists() else None  # fmt: skip
    tail = [v for s, v in train.items() if s > steps - steps // 10]  # equal windows: a mean
    return {
        "train_loss": sorted(train.items()),
        "train_loss_last_10pct": sum(tail) / len(tail) if tail and max(train) == steps else None,
        "val_loss": sorted(val.items()),
        "last_step": max(train) if train else 0,
        "final_val_loss": summary.get("final_val_loss"),
        "tokens_per_s": summary.get("tokens_per_s") or (sum(tps) / len(tps) if tps else None),
        "tokens_per_step": None,
        "wall_s": sum(x["wall_s"] for x in bench.get("launches", [])) or None,
        "train_time_s": summary.get("wall_time_s"),
        "fp8_log": fp8_line,
        "skipped_updates": len(skipped),
        # a run stopped early (--stop-at) has a summary too, of fewer steps
        "finished": bool(summary) and summary.get("steps") == max(train, default=-1) == steps,
        "command": portable(bench.get("command"), run_dir),
    }


def portable(cmd: list[str] | None, run_dir: Path) -> str | None:
    """The run's command line as one would type it, without this machine's paths."""
    if not cmd:
        return None
    words = ["hyperloom"] + cmd[cmd.index("hyperloom") + 1 :] if "hyperloom" in cmd else cmd
    words = [f"<run-root>/{run_dir.name}" if w == str(run_dir) else w for w in words]
    return " ".join(w if w else "''" for w in words)


def smooth(values: list[float], alpha: float = 0.1) -> list[float]:
    """Exponential moving average (bias-corrected), for the train-loss panel."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = (1 - alpha) * avg + alpha * v
        out.append(avg / (1 - (1 - alpha) ** i))
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["runs"]
    fig, (ax_t, ax_v, ax_d) = plt.subplots(1, 3, figsize=(16, 4.8))
    base_val = dict(runs["bf16"]["val_loss"]) if "bf16" in runs else {}
    late_t: list[float] = []  # the first tenth of training (from ~9.8) would flatten the rest
    for name, run in runs.items():
        style = {"lw": 1.2}
        if name in ("bf16", "fp32"):
            style = {"lw": 2.0, "color": "black", "ls": "-" if name == "bf16" else ":"}
        elif name in BF16_REPEATS:
            style = {"lw": 1.0, "color": "grey", "ls": "--"}
        steps, losses = zip(*run["train_loss"], strict=True) if run["train_loss"] else ((), ())
        smoothed = smooth(list(losses))
        ax_t.plot(steps, smoothed, label=name, **style)
        late_t += [v for s, v in zip(steps, smoothed, strict=True) if s >= out["steps"] // 10]
        vsteps, vlosses = zip(*run["val_loss"], strict=True) if run["val_loss"] else ((), ())
        ax_v.plot(vsteps, vlosses, marker="o", ms=3, label=name, **style)
        if name != "bf16" and base_val:
            common = [s for s in vsteps if s in base_val and s > 0]
            diff = [100 * (dict(run["val_loss"])[s] / base_val[s] - 1) for s in common]
            ax_d.plot(common, diff, marker="o", ms=3, label=name, lw=1.2)
    late = [v for r in runs.values() for s, v in r["val_loss"] if s >= out["steps"] // 10]
    if late:
        ax_v.set_ylim(min(late) - 0.1, max(late) + 0.1)
    if late_t:
        ax_t.set_ylim(min(late_t) - 0.1, max(late_t) + 0.1)
    ax_t.set(xlabel="step", ylabel="train loss (EMA 0.1)", title="train loss")
    ax_v.set(xlabel="step", ylabel="validation loss", title="validation loss")
    tol = out["tolerance_pct"]
    ax_d.axhspan(-tol, tol, color="green", alpha=0.1, label=f"±{tol}%")
    ax_d.axhline(0, color="black", lw=0.8)
    ax_d.set(xlabel="step", ylabel="val loss vs BF16 (%)", title="relative difference from BF16")
    for ax in (ax_t, ax_v, ax_d):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{out['model']} Llama, {out['steps']} steps (warmup {out.get('warmup_steps')}), "
        f"{out['tokens_per_step']} tokens/step "
        f"(micro-batch {out['micro_batch']} x seq {out['seq_len']}), seed {out['seed']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# the schedule of the JSONs written before the JSON recorded it: the job's warmup and peak then
RECORDED_LATER = {"warmup_steps": 30, "lr": 3e-3}


def combine(paths: list[Path], out_path: Path, tolerance: float) -> dict[str, Any]:
    """Per recipe over seeds (module docstring); the seeds' runs must share every setting."""
    parts = [json.loads(p.read_text()) for p in paths]
    for part in parts:
        for key, value in RECORDED_LATER.items():
            part.setdefault(key, value)
    keys = ("model", "steps", "warmup_steps", "lr", "micro_batch", "seq_len", "eval_batches",
            "on_anomaly")  # fmt: skip
    for key in keys:
        if len({json.dumps(part.get(key)) for part in parts}) > 1:
            raise SystemExit(f"--combine: the runs differ in {key}; only --seed may differ")
    seeds = [part["seed"] for part in parts]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--combine: seeds repeat ({seeds})")
    recipes = [r for r in parts[0]["runs"] if all(r in part["runs"] for part in parts)]
    out: dict[str, Any] = {k: parts[0].get(k) for k in keys + ("tokens_per_step",)}
    out.update(seeds=seeds, tolerance_pct=tolerance, recipes={})
    for r in recipes:
        runs = [part["runs"][r] for part in parts]
        finals = [run["final_val_loss"] for run in runs]
        diffs = [run["diff_vs_bf16_pct"] for run in runs]
        bases = [part["runs"]["bf16"]["final_val_loss"] for part in parts]
        out["recipes"][r] = {
            "final_val_loss": finals,
            "diff_vs_bf16_pct": diffs,
            "mean_diff_pct": sum(diffs) / len(diffs),
            "diff_of_means_pct": 100 * (sum(finals) / sum(bases) - 1),
            "train_diff_vs_bf16_pct": [run["train_diff_vs_bf16_pct"] for run in runs],
            "skipped_updates": [run.get("skipped_updates") for run in runs],
            "finished": all(run["finished"] for run in runs),
        }
    out["verdict"] = {
        r: {"mean_diff_pct": v["mean_diff_pct"], "within": abs(v["mean_diff_pct"]) <= tolerance}
        for r, v in out["recipes"].items()
        if r in JUDGED
    }
    print(
        f"{len(seeds)} seeds {seeds}, {out['steps']} steps (warmup {out['warmup_steps']}, "
        f"lr {out['lr']:g}), {out['tokens_per_step']} tokens/step"
    )
    print(f"{'recipe':<11}" + "".join(f"{'seed ' + str(s):>16}" for s in seeds) + f"{'mean':>10}")
    for r, v in out["recipes"].items():
        cells = "".join(
            f"{f'{f:.4f} ({d:+.2f}%)':>16}"
            for f, d in zip(v["final_val_loss"], v["diff_vs_bf16_pct"], strict=True)
        )
        print(f"{r:<11}{cells}{v['mean_diff_pct']:>+9.2f}%")
    for r, v in out["verdict"].items():
        state = "within" if v["within"] else "NOT within"
        print(f"{r}: mean over seeds {v['mean_diff_pct']:+.2f}%, {state} {tolerance}% of BF16")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    print(f"wrote {out_path}")
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, in run order")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=0, help="train.micro_batch_size (0 = job's)")
    ap.add_argument("--seq-len", type=int, default=0, help="data.seq_len (0 = the job's)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--qk-norm", action="store_true", help="every run with model.qk_norm (module docstring)"
    )
    ap.add_argument(
        "--on-anomaly",
        default="none",
        choices=["none", "skip"],
        help="the training guard's action on a loss/grad spike (module docstring)",
    )
    ap.add_argument(
        "--warmup-steps",
        type=int,
        help="train.warmup_steps (default: the job's, stretched to --steps; docstring)",
    )
    ap.add_argument("--lr", type=float, help="train.lr, the peak learning rate (default: job's)")
    stop = "stop every run at this step (train.stop_at_step); a later call without it goes on"
    ap.add_argument("--stop-at", type=int, default=0, help=stop)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--checkpoint-every", type=int, default=250)
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time")
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS per run (0 = torch's)")
    ap.add_argument("--tolerance", type=float, default=0.5, help="percent, for blockwise/current")
    ap.add_argument("--run-root", type=Path, default=Path("runs/fp8_convergence"))
    ap.add_argument("--collect", action="store_true", help="train nothing; gather the run dirs")
    ap.add_argument(
        "--combine", type=Path, nargs="+", help="train nothing; summarise these JSONs over seeds"
    )
    ap.add_argument("--json", type=Path, default=RESULTS / "fp8_convergence.json")
    ap.add_argument("--plot", type=Path, default=RESULTS / "fp8_convergence.png")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.combine:
        combine(args.combine, args.json, args.tolerance)
        return
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = sorted(set(recipes) - set(RECIPES) - set(CONTROLS))
    if unknown:
        known = ", ".join(RECIPES + CONTROLS)
        raise SystemExit(f"unknown recipes {unknown}; choose from {known}")

    start = time.perf_counter()
    if not args.collect:
        run_all(recipes, args)
    from hyperloom.config import JobConfig

    job = JobConfig()  # the default job: what --micro-batch / --seq-len = 0 mean
    micro_batch = args.micro_batch or job.train.micro_batch_size
    seq_len = args.seq_len or job.data.seq_len
    out: dict[str, Any] = {
        "model": job.model.preset + ("+qk_norm" if args.qk_norm else ""),
        "steps": args.steps,
        "warmup_steps": warmup_steps(args),
        "lr": job.train.lr if args.lr is None else args.lr,
        "seed": args.seed,
        "on_anomaly": args.on_anomaly,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "tokens_per_step": micro_batch * seq_len,
        "default_tokens_per_step": job.train.micro_batch_size * job.data.seq_len,
        "eval_every": args.eval_every,
        "eval_batches": args.eval_batches,
        "parallel": args.parallel,
        "threads_per_run": args.threads or None,
        "tolerance_pct": args.tolerance,
        "runs": {},
    }
    for recipe in recipes:
        run = collect(args.run_root / recipe, args.steps)
        if run is not None:
            run["tokens_per_step"] = out["tokens_per_step"]
            out["runs"][recipe] = run
    base = out["runs"].get("bf16", {}).get("final_val_loss")
    for run in out["runs"].values():
        fv = run["final_val_loss"]
        run["diff_vs_bf16_pct"] = 100 * (fv / base - 1) if fv is not None and base else None
        tl, tb = (
            run["train_loss_last_10pct"],
            out["runs"].get("bf16", {}).get("train_loss_last_10pct"),
        )
        run["train_diff_vs_bf16_pct"] = 100 * (tl / tb - 1) if tl is not None and tb else None
    verdict = {}
    for name in JUDGED:
        run = out["runs"].get(name)
        ok = run is not None and run["finished"] and base is not None
        d = run["diff_vs_bf16_pct"] if ok else None
        verdict[name] = {"diff_pct": d, "within": None if d is None else abs(d) <= args.tolerance}
    repeats = [  # a repeat measures noise only beside the BF16 run it repeats
        runs_d
        for r in BF16_REPEATS
        if (runs_d := out["runs"].get(r)) and runs_d["finished"] and base is not None
    ]
    base_val = dict(out["runs"].get("bf16", {}).get("val_loss", []))

    def drift(run: dict[str, Any]) -> float:
        """Largest |val loss / BF16's - 1| (%) over the second half of the evaluations: where a
        repeat wanders by rounding alone, one end point is a draw from that spread."""
        late = [(s, v) for s, v in run["val_loss"] if s >= args.steps // 2 and s in base_val]
        return max((abs(100 * (v / base_val[s] - 1)) for s, v in late), default=0.0)

    out["bf16_repeat_final_drift_pct"] = max(  # None when BF16 itself is not among the runs
        (abs(r["diff_vs_bf16_pct"]) for r in repeats), default=None
    )
    floor = max((drift(r) for r in repeats), default=None)
    out["bf16_noise_floor_pct"] = floor  # a BF16 repeat's largest drift over the second half
    for v in verdict.values():
        d = v["diff_pct"]
        v["within_noise_floor"] = None if d is None or floor is None else abs(d) <= floor
    out["verdict"] = verdict
    runs = out["runs"]
    out["not_finished"] = [r for r in RECIPES if r not in runs or not runs[r]["finished"]]
    out["seconds_this_invocation"] = time.perf_counter() - start

    print(
        f"{out['model']} Llama, {args.steps} steps (warmup {out['warmup_steps']}, lr "
        f"{out['lr']:g}), micro-batch {micro_batch} x seq {seq_len} = "
        f"{out['tokens_per_step']} tokens/step (default job: {out['default_tokens_per_step']})"
    )
    print(
        f"{'recipe':<11}{'steps':>6}{'final val':>11}{'vs BF16':>10}"
        f"{'train@end':>11}{'vs BF16':>10}{'tok/s':>9}{'wall (min)':>12}  FP8 active"
    )
    for name, run in out["runs"].items():
        d = run["diff_vs_bf16_pct"]
        fv = run["final_val_loss"]
        wall = run["wall_s"]
        tl, td = run["train_loss_last_10pct"], run["train_diff_vs_bf16_pct"]
        print(
            f"{name:<11}{run['last_step']:>6}"
            f"{'-' if fv is None else f'{fv:.4f}':>11}"
            f"{'-' if d is None else f'{d:+.2f}%':>10}"
            f"{'-' if tl is None else f'{tl:.4f}':>11}"
            f"{'-' if td is None else f'{td:+.2f}%':>10}"
            f"{run['tokens_per_s'] or 0:>9.0f}"
            f"{'-' if wall is None else f'{wall / 60:.1f}':>12}  {run['fp8_log'] or '-'}"
        )
    for name, v in verdict.items():
        state = {None: "not finished", True: "within", False: "NOT within"}[v["within"]]
        shown = "" if v["diff_pct"] is None else f" ({v['diff_pct']:+.2f}%)"
        print(f"{name}: {state} {args.tolerance}% of BF16 final val loss{shown}")
    if floor is not None:
        print(
            f"the BF16 repeat (rounding points only) ends {out['bf16_repeat_final_drift_pct']:.2f}% "
            f"from BF16 and wanders up to {floor:.2f}% over the second half of training"
        )
        for name, v in verdict.items():
            if v["within_noise_floor"] is not None:
                where = "inside" if v["within_noise_floor"] else "outside"
                print(f"{name}: {where} that noise floor")
    if out["not_finished"]:
        print(f"not finished {args.steps} steps: {', '.join(out['not_finished'])}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    if out["runs"]:
        plot(out, args.plot)
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
