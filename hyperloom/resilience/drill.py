"""`hyperloom drill KIND`: break a real training run on purpose and show that it heals.

Each drill runs `hyperloom train` with one injected fault, lets the resilience machinery deal
with it, and reports what was injected, what the run did (from events.log) and, with
`--reference` (the default), how the result compares with a clean run of the same job:
bitwise on the final weights where recovery replays exactly, validation loss otherwise. Kinds
with an expected event in `EVENT` pass only if events.log has it. The kinds and their expected
recoveries are tabled in docs/resilience.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from hyperloom.config.args import number
from hyperloom.resilience.inject import SAVE_FAULTS

log = logging.getLogger("hyperloom.drill")

KINDS = (
    "crash",
    "kill_during_save",
    "writer_crash",
    "hang",
    "corrupt_latest",
    "uncommitted_latest",
    "disk_full",
    "nan",
    "spike",
)
EXACT = set(KINDS) - {"nan", "spike"}  # bit for bit
# The event that shows the recovery happened (events.log), where it is certain to appear.
EVENT = {
    "writer_crash": "checkpoint_failed",
    "corrupt_latest": "checkpoint_fallback",
    "uncommitted_latest": "checkpoint_fallback",
    "disk_full": "checkpoint_failed",
}
# One line per drill for `hyperloom drill --help` (the module docstring has the details).
SUMMARY = {
    "crash": "the process dies after step K; restart, resume, bitwise",
    "kill_during_save": "the process dies half-way through the save of step K; bitwise",
    "writer_crash": "the async writer dies half-way through the save of step K, the process "
    "crashes after step K+every+1; the retry commits K, bitwise",
    "hang": "no progress after step K; the watchdog exits, restart, bitwise",
    "corrupt_latest": "a byte of the newest checkpoint flipped after a stop at K; "
    "falls back, bitwise",
    "uncommitted_latest": "the newest checkpoint's meta.json deleted after a stop at K; "
    "falls back, bitwise",
    "disk_full": "ENOSPC half-way through the save of step K; the retry commits it, bitwise",
    "nan": "NaN gradients at step K; rollback, validation loss within 2%",
    "spike": "loss and gradients x30 at step K; rollback, validation loss within 2%",
}


class DrillError(RuntimeError):
    """A drill could not run or its run did not heal (the message says which)."""


def _train(args: list[str], nproc: int, restarts: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hyperloom", "train", *args, "--nproc", str(nproc)]
    if restarts:
        cmd += ["--max-restarts", str(restarts)]
    log.info("drill: %s", " ".join(cmd[2:]))
    return subprocess.run(cmd, capture_output=True, text=True)


def _fail(what: str, proc: subprocess.CompletedProcess) -> DrillError:
    return DrillError(
        f"{what} (exit status {proc.returncode}); its output ends:\n{proc.stderr[-3000:]}"
    )


def corrupt(ckpt_dir: Path) -> str:
    """Flip one byte in the middle of a checkpoint's weights (a sharded checkpoint: of rank
    0's shard file); returns what was done."""
    f = ckpt_dir / "model.safetensors"
    if not f.is_file():
        f = ckpt_dir / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    return f"flipped byte {len(data) // 2} of {f.relative_to(ckpt_dir.parent.parent)}"


def uncommit(ckpt_dir: Path) -> str:
    """Delete a checkpoint's commit record (`meta.json`, written last by
    hyperloom.checkpoint.commit); returns what was done."""
    f = ckpt_dir / "meta.json"
    f.unlink()
    return f"deleted the commit record {f.relative_to(ckpt_dir.parent.parent)}"


DAMAGE = {"corrupt_latest": corrupt, "uncommitted_latest": uncommit}


def run_drill(
    kind: str,
    run_dir: Path,
    config: str | None,
    overrides: list[str],
    at: int,
    nproc: int = 1,
    reference: bool = True,
    watchdog_s: float = 5.0,
) -> dict[str, Any]:
    """Run drill `kind` in `run_dir` and return its report (also written to drill.json)."""
    from hyperloom import checkpoint as ckpt
    from hyperloom.config import load_config
    from hyperloom.resilience.events import read_events
    from hyperloom.resilience.lock import RunDirLock

    if kind not in KINDS:
        raise DrillError(f"unknown drill {kind!r}; drills are: {', '.join(KINDS)}")
    if run_dir.exists():
        with RunDirLock(run_dir).acquire(wait_s=0):  # never a directory a job is using
            shutil.rmtree(run_dir)
    base = ([config] if config else []) + overrides
    cfg = load_config(config, overrides, world_size=nproc)
    every = cfg.checkpoint.every
    if every == 0:
        raise DrillError("drills need periodic checkpoints: add --checkpoint.every N (e.g. 2)")
    if kind in SAVE_FAULTS and at % every:
        raise DrillError(f"{kind}@{at} needs a checkpoint at step {at}: every={every}")
    later_crash = at + every + 1  # writer_crash: after the next save has started
    if kind == "writer_crash" and later_crash >= cfg.train.steps:
        raise DrillError(
            f"writer_crash@{at} crashes the process after step {at} + {every} + 1 = "
            f"{later_crash}, which must lie before the last step {cfg.train.steps}"
        )
    if kind == "spike" and at <= cfg.resilience.warmup:
        raise DrillError(
            f"spikes are judged after resilience.warmup = {cfg.resilience.warmup} healthy steps; "
            f"use --at above it or lower --resilience.warmup"
        )
    if not 0 < at < cfg.train.steps:
        raise DrillError(f"--at {at} must lie inside the run's 1..{cfg.train.steps - 1} steps")
    report: dict[str, Any] = {"drill": kind, "at_step": at, "run_dir": str(run_dir)}
    mine = base + ["--logging.run_dir", str(run_dir)]

    if reference:
        ref_dir = run_dir / "reference"
        ref_args = base + ["--logging.run_dir", str(ref_dir), "--resilience.on_anomaly", "none"]
        proc = _train(ref_args, nproc, 0)
        if proc.returncode:
            raise _fail("the clean reference run failed", proc)

    if kind in ("crash", "kill_during_save", "hang", "disk_full", "writer_crash"):
        spec = f"{kind}@{at}"
        extra = []
        if kind == "hang":
            extra += ["--resilience.watchdog_s", str(watchdog_s)]
        if kind == "writer_crash":
            spec += f",crash@{later_crash}"
            extra += ["--checkpoint.async_save", "true"]
        proc = _train(mine + extra + ["--resilience.inject", spec], nproc, 1)
        if proc.returncode:
            raise _fail(f"the run did not recover from {spec}", proc)
    elif kind in DAMAGE:
        first = _train(mine + ["--train.stop_at_step", str(at)], nproc, 0)
        if first.returncode:
            raise _fail("the first half of the run failed", first)
        latest = ckpt.latest_checkpoint(run_dir)
        assert latest is not None
        report["damage"] = DAMAGE[kind](latest)
        proc = _train(mine, nproc, 0)
        if proc.returncode:
            raise _fail(f"the run did not recover from {kind}", proc)
    else:
        spec = f"{'nan_grad' if kind == 'nan' else 'loss_spike'}@{at}"
        proc = _train(
            mine + ["--resilience.on_anomaly", "rollback", "--resilience.inject", spec], nproc, 0
        )
        if proc.returncode:
            raise _fail(f"the run did not recover from {spec}", proc)

    summary = json.loads((run_dir / "summary.json").read_text())
    report.update(
        completed=summary["steps"] == cfg.train.steps,
        steps=summary["steps"],
        final_val_loss=summary["final_val_loss"],
        events=[line.split(" ", 2)[-1] for line in read_events(run_dir)],
        hang_stacks=sorted(p.name for p in run_dir.glob("hang_rank*.txt")),
    )
    healed = report["completed"]
    if kind in EVENT:
        report["expected_event"] = EVENT[kind]
        report["event_seen"] = any(f"[{EVENT[kind]}]" in e for e in report["events"])
        healed = healed and report["event_seen"]
    if reference:
        ref = json.loads((ref_dir / "summary.json").read_text())
        report["reference_val_loss"] = ref["final_val_loss"]
        report["val_loss_rel_diff"] = abs(ref["final_val_loss"] - summary["final_val_loss"]) / abs(
            ref["final_val_loss"]
        )
        final = f"step_{cfg.train.steps:08d}"
        same = _same_weights(run_dir / "checkpoints" / final, ref_dir / "checkpoints" / final)
        report["weights_bitwise_equal"] = same
        ok = same if kind in EXACT else report["val_loss_rel_diff"] <= 0.02
        report["passed"] = bool(healed and ok)
    else:
        report["passed"] = bool(healed)
    (run_dir / "drill.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _same_weights(a: Path, b: Path) -> bool:
    from hyperloom.checkpoint import load_model_state

    wa, wb = load_model_state(a), load_model_state(b)  # either checkpoint format
    return list(wa) == list(wb) and all(wa[k].equal(wb[k]) for k in wa)


def cmd_drill(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    run_dir = Path(args.run_dir or f"runs/drill-{args.kind}")
    try:
        report = run_drill(
            args.kind,
            run_dir,
            args.config,
            list(args.overrides),
            args.at,
            nproc=args.nproc,
            reference=not args.no_reference,
            watchdog_s=args.watchdog_s,
        )
    except DrillError as exc:
        print(f"hyperloom drill {args.kind}: FAILED: {exc}", file=sys.stderr)
        return 1
    table = Table(title=f"drill {args.kind}@{args.at}", show_header=False, title_style="bold")
    table.add_column("what", style="bold")
    table.add_column("result")
    for key, value in report.items():
        if key == "events":
            value = "\n".join(value) or "-"
        table.add_row(key.replace("_", " "), escape(str(value)))  # events hold [tags]
    Console(width=160).print(table)
    return 0 if report["passed"] else 1


def add_drill_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drill",
        help="inject a fault into a training run and check that it heals",
        description="Run a clean reference and a run with one fault at step K (--at), and\n"
        "compare. Config overrides as for train; the job needs --checkpoint.every N.",
        epilog="drills:\n" + "\n".join(f"  {k:<19} {v}" for k, v in SUMMARY.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("kind", choices=KINDS)
    p.add_argument("config", nargs="?", help="TOML job file (default: the built-in tiny job)")
    p.add_argument("--run-dir", help="directory for the drill's runs (default runs/drill-KIND)")
    p.add_argument(
        "--at", type=number(int, least=1), default=5, help="step at which the fault strikes"
    )
    p.add_argument("--nproc", type=number(int, least=1), default=1, help="processes (torchrun)")
    p.add_argument("--no-reference", action="store_true", help="skip the clean reference run")
    p.add_argument(
        "--watchdog-s", type=number(above=0), default=5.0, help="watchdog timeout (hang drill)"
    )
    p.set_defaults(func=cmd_drill, accepts_overrides=True)
