"""Activation recompute per policy, measured beside the planner's predictions, in two parts.

Training runs (the issue's table): each `train.recompute` policy is one `hyperloom train` run
of the default model at a sequence length where activations dominate (fp32: this CPU has no
fast BF16), whose self-check (`planner.selfcheck`, one profile of this machine measured
first) puts the predicted peak memory above the pre-model baseline and step time beside the
measured ones. Then `auto` runs with a budget halfway between the measured `full` and `none`
peaks: it must fit and be no more than 5% slower than the fastest policy that fits.

Live bytes: the same jobs under `planner_memory_probe.py`, which polls glibc's live heap
bytes through a step: the peak of the tensors themselves (what a device's caching allocator
reports as max allocated) beside the planner's live peak, without the host allocator's
resident extra, which the training runs' peak RSS includes.

Blocks: what a transformer block keeps for its backward, counted by a saved-tensor hook in
one forward (each storage once, parameters and buffers not counted -- the planner counts
those, and under BF16 autocast the weights' casts, once per step, not per micro-batch),
against the planner's `planner.memory.saved_bytes` of the same layer.

    python benchmarks/recompute.py [--seq 2048 --mbs 4 --steps 4] [--skip-train]

Prints both tables and writes benchmarks/results/recompute.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import machine
import torch
from rich.console import Console
from rich.table import Table

from hyperloom.config import RECOMPUTE_CANDIDATES, load_config
from hyperloom.models.registry import build_model, family
from hyperloom.parallel.parallelize import materialize, select_ops
from hyperloom.parallel.recompute import apply_recompute
from hyperloom.planner import ModelSpec
from hyperloom.planner.memory import saved_bytes
from hyperloom.planner.model import build_layer

# the default model is dense: the routed experts' module has nothing to recompute there
POLICIES = [p for p in RECOMPUTE_CANDIDATES if "experts" not in p]
DEFAULT_JSON = Path(__file__).parent / "results" / "recompute.json"


def measure(cfg, policy: str, mbs: int, seq: int, dtype: torch.dtype) -> int:
    """Bytes the blocks keep for the backward per micro-batch (module docstring)."""
    model = build_model(cfg.model)
    apply_recompute(model, policy, 0, family(cfg.model.family).recompute_plan(cfg.model))
    materialize(model, torch.device("cpu"), cfg.train.seed)
    select_ops(model, cfg)
    model.train()
    constant = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    weight_shapes = {tuple(w.shape) for w in model.parameters()}
    inside = [False]
    saved: dict[int, torch.Tensor] = {}

    def keep(t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        cast = t.dtype != torch.float32 and tuple(t.shape) in weight_shapes  # autocast's
        if key not in constant and not cast:
            saved[key] = t

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0]:
            keep(t)
        return t

    def enter(_m, args):
        inside[0] = True
        if policy == "full":  # the checkpoint keeps the block's input
            keep(args[0])

    def leave(_m, _args, _out):
        inside[0] = False

    for block in model.layers.values():
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    tokens = torch.randint(0, cfg.model.vocab_size, (mbs, seq), generator=torch.Generator())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            model(tokens, labels=tokens)
    return sum(t.untyped_storage().nbytes() for t in saved.values()) // cfg.model.n_layers


def train_runs(args: argparse.Namespace, console: Console) -> dict:
    """Every policy, then auto at a budget between full and none: `hyperloom train` runs."""
    from planner_validation import calibrate, run_config

    shape = ["--train.micro_batch_size", str(args.mbs), "--data.seq_len", str(args.seq),
             "--precision.dtype", "fp32"]  # fmt: skip
    rows, runs = [], {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        console.print("calibrating the planner on this machine ...")
        profile = calibrate(tmp / "profile.json", "fp32")  # the runs' dtype
        for i, policy in enumerate([*POLICIES, "auto"], 1):
            extra = [*shape, "--train.recompute", policy]
            if policy == "auto":
                none, full = runs["none"]["peak_gb"], runs["full"]["peak_gb"]
                budget = (none + full) / 2
                extra += ["--train.memory_budget_gb", f"{budget:.4f}"]
            console.print(f"[{i}/{len(POLICIES) + 1}] hyperloom train --train.recompute {policy}")
            name = policy.replace(",", "+")
            r = run_config(name, 1, extra, profile, args.steps, tmp)
            if "error" in r:
                raise SystemExit(f"{policy} failed:\n{r['error']}")
            summary = json.loads((tmp / name / "summary.json").read_text())
            r |= {"policy": policy, "peak_gb": summary["peak_memory_gb"]}
            if policy == "auto":
                r |= {"budget_gb": budget, "auto": summary["recompute_auto"]}
            runs[policy] = r
            rows.append(r)
    return check(rows, runs, console)


def live_runs(args: argparse.Namespace, console: Console) -> list[dict]:
    """Per policy, the live heap bytes at the step's peak (glibc's, polled through a step by
    `planner_memory_probe.py`; on a device the caching allocator's max allocated) beside the
    planner's live peak: the memory model without the host allocator's resident extra."""
    from planner_memory_probe import predicted_live_bytes, probe

    shape = ["--train.micro_batch_size", str(args.mbs), "--data.seq_len", str(args.seq),
             "--precision.dtype", "fp32"]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, policy in enumerate(POLICIES, 1):
            console.print(f"[{i}/{len(POLICIES)}] live bytes under --train.recompute {policy}")
            overrides = [*shape, "--train.recompute", policy]
            (rank,) = probe(policy, 1, 2, str(Path(tmp) / "probe.json"), overrides)
            predicted = predicted_live_bytes(1, overrides)
            measured = rank["live_peak_last_step"]
            rows.append({"policy": policy, "measured_live_gb": measured / 1e9,
                         "predicted_live_gb": predicted / 1e9,
                         "error": predicted / measured - 1,
                         "resident_gb": rank["resident_peak"] / 1e9})  # fmt: skip
    table = Table(title="live bytes at the step's peak (above baseline): predicted vs measured")
    for col in ("policy", "live meas GB", "live pred GB", "error", "resident GB"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        table.add_row(r["policy"], f"{r['measured_live_gb']:.3f}", f"{r['predicted_live_gb']:.3f}",
                      f"{r['error']:+.1%}", f"{r['resident_gb']:.3f}")  # fmt: skip
    console.print(table)
    return rows


def check(rows: list[dict], runs: dict, console: Console) -> dict:
    """The table, and the issue's three checks, each with its numbers."""
    table = Table(title="recompute in training: predicted vs measured (peak above baseline)")
    for col in ("policy", "peak meas GB", "peak pred GB", "error", "step meas s",
                "step pred s", "error"):  # fmt: skip
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        table.add_row(
            r["policy"] if r["policy"] != "auto" else f"auto -> {r['auto']['policy_by_stage'][0]}",
            f"{r['measured_peak_memory_gb']:.3f}",
            f"{r['predicted_peak_memory_gb']:.3f}",
            f"{r['memory_error']:+.1%}",
            f"{r['measured_step_s']:.2f}",
            f"{r['predicted_step_s']:.2f}",
            f"{r['step_time_error']:+.1%}",
        )
    console.print(table)
    policies = [r for r in rows if r["policy"] != "auto"]
    by_measured = [
        r["policy"] for r in sorted(policies, key=lambda r: -r["measured_peak_memory_gb"])
    ]
    by_predicted = [
        r["policy"] for r in sorted(policies, key=lambda r: -r["predicted_peak_memory_gb"])
    ]
    within = [r["policy"] for r in policies if abs(r["memory_error"]) <= 0.10]
    auto = runs["auto"]
    chosen = auto["auto"]["policy_by_stage"][0]
    fitting = [r for r in policies if r["peak_gb"] <= auto["budget_gb"]]
    fastest = min(fitting, key=lambda r: r["measured_step_s"]) if fitting else None
    checks = {
        "peak_order_measured": by_measured,
        "peak_order_predicted": by_predicted,
        "same_order": by_measured == by_predicted,
        "within_10pct": within,
        "all_within_10pct": len(within) == len(policies),
        "auto_budget_gb": auto["budget_gb"],
        "auto_chose": chosen,
        "auto_measured_peak_gb": auto["peak_gb"],
        "auto_fits": auto["peak_gb"] <= auto["budget_gb"],
        "fastest_fitting": fastest and fastest["policy"],
        "auto_slowdown_vs_fastest_fitting": fastest
        and auto["measured_step_s"] / fastest["measured_step_s"] - 1,
    }
    checks["auto_within_5pct"] = bool(
        checks["auto_fits"] and fastest and checks["auto_slowdown_vs_fastest_fitting"] <= 0.05
    )
    console.print(
        f"peak order measured {by_measured}\n           predicted {by_predicted}: "
        f"{'same' if checks['same_order'] else 'DIFFERENT'}; within 10%: {len(within)}/"
        f"{len(policies)}; auto at {auto['budget_gb']:.3f} GB chose {chosen}, measured peak "
        f"{auto['peak_gb']:.3f} GB ({'fits' if checks['auto_fits'] else 'DOES NOT FIT'}), "
        f"step vs fastest fitting ({checks['fastest_fitting']}): "
        + (f"{checks['auto_slowdown_vs_fastest_fitting']:+.1%}" if fastest else "-")
    )
    return {"rows": rows, "checks": checks}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="training steps per run (first untimed)")
    p.add_argument("--block-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--skip-train", action="store_true", help="the block table only")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    console = Console()
    overrides = ["--data.seq_len", str(args.seq), "--logging.run_dir", tempfile.mkdtemp()]
    cfg = load_config(None, overrides)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.block_dtype]
    bf16 = dtype == torch.bfloat16  # autocast casts per op; FP32 keeps FP32 activations
    layer = build_layer(ModelSpec.from_model_config(cfg.model), args.mbs, args.seq, 1, 1,
                        False, per_op_casts=bf16, act_width=dtype.itemsize)  # fmt: skip
    blocks = []
    table = Table(title=f"what a block keeps: default model, {args.mbs} x {args.seq}, "
                  f"{args.block_dtype}")  # fmt: skip
    for col in ("policy", "measured MiB", "planner MiB", "error"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for policy in POLICIES:
        got, predicted = measure(cfg, policy, args.mbs, args.seq, dtype), saved_bytes(layer, policy)
        blocks.append({"policy": policy, "measured": got, "planner": predicted})
        table.add_row(policy, f"{got / 2**20:.2f}", f"{predicted / 2**20:.2f}",
                      f"{got / predicted - 1:+.2%}")  # fmt: skip
    console.print(table)
    record = {"settings": vars(args) | {"json": str(args.json)}, "blocks": blocks}
    if not args.skip_train:
        record["train"] = train_runs(args, console)
        record["live"] = live_runs(args, console)
        live = record["live"]
        order = [r["policy"] for r in sorted(live, key=lambda r: -r["measured_live_gb"])]
        predicted = [r["policy"] for r in sorted(live, key=lambda r: -r["predicted_live_gb"])]
        within = sum(abs(r["error"]) <= 0.10 for r in live)
        # pairs the planner separates by more than 2%: does the measurement order them so?
        pairs = [(a, b) for a in live for b in live
                 if a["predicted_live_gb"] > 1.02 * b["predicted_live_gb"]]  # fmt: skip
        agree = sum(a["measured_live_gb"] > b["measured_live_gb"] for a, b in pairs)
        record["train"]["checks"] |= {
            "live_order_measured": order,
            "live_order_predicted": predicted,
            "live_pairs_ordered_as_predicted": [agree, len(pairs)],
            "live_within_10pct": within,
        }
        console.print(f"live peak order measured {order}\n                predicted "
                      f"{predicted}; pairs apart by > 2% ordered as predicted: {agree}/"
                      f"{len(pairs)}; within 10%: {within}/{len(live)}")  # fmt: skip
    record["machine"] = machine.machine_info(0, "cpu")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    machine.write_results(args.json, record)
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
