"""The `[resilience]` section, and the grammar of its fault-drill specs.

`parse_inject` reads `resilience.inject = "kind@step[:rRANK],..."` into `Fault`s. It lives
here, with the section, so that validating a job can parse a spec without importing the
runtime that fires the faults (hyperloom.resilience.inject, which documents each kind).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig

KINDS = (
    "nan_grad",
    "loss_spike",
    "crash",
    "hang",
    "kill_during_save",
    "disk_full",
    "writer_crash",
    "stall_save",
)
NUMERIC = ("nan_grad", "loss_spike")


@dataclass(frozen=True)
class Fault:
    """One drill: `kind` fires at `step` on `rank`."""

    kind: str
    step: int
    rank: int | None  # None: every rank for numeric faults, rank 0 otherwise

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.step}" + ("" if self.rank is None else f":r{self.rank}")

    def hits(self, rank: int) -> bool:
        if self.rank is not None:
            return rank == self.rank
        return self.kind in NUMERIC or rank == 0


def parse_inject(spec: str) -> list[Fault]:
    """`"nan_grad@5,crash@7:r1"` -> faults; ValueError says what is allowed."""
    faults = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        kind, _, rest = item.partition("@")
        step_s, _, rank_s = rest.partition(":")
        ok = kind in KINDS and step_s.isdigit() and int(step_s) >= 1
        ok = ok and (not rank_s or (rank_s[:1] == "r" and rank_s[1:].isdigit()))
        if not ok:
            raise ValueError(
                f"cannot read {item!r}: write kind@step or kind@step:rRANK with kind one of "
                f"{', '.join(KINDS)} and step >= 1 (e.g. nan_grad@5, crash@4:r1)"
            )
        faults.append(Fault(kind, int(step_s), int(rank_s[1:]) if rank_s else None))
    return faults


@dataclass(frozen=True)
class ResilienceConfig:
    """Anomaly detection, recovery, hang watchdog and fault drills (hyperloom.resilience)."""

    on_anomaly: str = knob(
        "skip",
        "on NaN/Inf or a spike: skip the update, rollback to the last stable checkpoint, "
        "stop, or none (no checks, no per-step sync)",
        choices=["skip", "rollback", "stop", "none"],
    )
    window: int = knob(128, "healthy steps in the running mean/sigma/max of loss and grad norm")
    sigma: float = knob(
        6.0, "a spike is above mean + sigma x std of the window (inf = never)", inf_ok=True
    )
    max_factor: float = knob(
        10.0, "... or above this factor x the window's maximum (inf = never)", inf_ok=True
    )
    warmup: int = knob(64, "healthy steps before spikes are checked (NaN/Inf always are)")
    stable_steps: int = knob(10, "healthy steps after a checkpoint that make it stable")
    lr_factor: float = knob(1.0, "multiply the learning rate by this after each rollback")
    max_skips: int = knob(
        3,
        "skip: after this many skipped updates in a row, roll back to the last stable "
        "checkpoint (stop if there is none)",
    )
    max_rollbacks: int = knob(3, "give up after this many rollbacks within rollback_window")
    rollback_window: int = knob(1000, "steps over which rollbacks are counted")
    watchdog_s: float = knob(0.0, "exit (for torchrun to restart) after this long without a step")
    max_stalled_restarts: int = knob(3, "stop after this many restarts without progress")
    inject: str = knob(
        "",
        "fault drill: kind@step[,...] with kind nan_grad, loss_spike, crash, hang, "
        "kill_during_save, disk_full, writer_crash, stall_save (also from HYPERLOOM_INJECT)",
    )

    def problems(self, job: JobConfig) -> list[str]:
        """Detector settings in range; rollback and drills against the checkpoint settings."""
        r, p = self, []
        checks = (("window", 2), ("max_skips", 1), ("max_rollbacks", 1), ("rollback_window", 1))
        for key, least in checks:
            if getattr(r, key) < least:
                p.append(f"resilience.{key} must be >= {least}, got {getattr(r, key)}")
        if r.sigma <= 0:
            p.append(f"resilience.sigma must be positive, got {r.sigma}")
        if r.max_factor <= 1:
            p.append(f"resilience.max_factor must exceed 1, got {r.max_factor}")
        for key in ("warmup", "stable_steps", "watchdog_s", "max_stalled_restarts"):
            if getattr(r, key) < 0:
                p.append(f"resilience.{key} must be >= 0, got {getattr(r, key)}")
        if not 0 < r.lr_factor <= 1:
            p.append(f"resilience.lr_factor must lie in (0, 1], got {r.lr_factor}")
        if r.on_anomaly == "rollback" and job.checkpoint.every == 0:
            p.append(
                "resilience.on_anomaly = 'rollback' needs periodic checkpoints to roll back to; "
                "set checkpoint.every > 0 (or use 'skip' or 'stop')"
            )
        try:
            faults = parse_inject(r.inject)
        except ValueError as exc:
            p.append(f"resilience.inject: {exc}")
            faults = []
        if any(f.kind == "writer_crash" for f in faults) and not job.checkpoint.async_save:
            p.append(
                "resilience.inject: writer_crash crashes the background checkpoint writer; "
                "set checkpoint.async_save = true"
            )
        return p
