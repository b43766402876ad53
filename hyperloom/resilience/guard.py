"""The trainer's resilience hooks in one object: checks, recovery, saves, watchdog, drills.

The trainer calls a `Guard` at a handful of points (`inject_grads`, `healthy`, `after_step`,
`save`, `latest_checkpoint`, `start`, `close`) and otherwise knows nothing of resilience; the
guard sees the trainer only through `GuardedRun` and checkpoints only through
hyperloom.checkpoint. Every decision is identical on every rank (checked values are
all-reduced first; rollback targets are read from the shared file system). The guard owns the
learning-rate scale that rollbacks lower (`lr_scale`), saved with its state.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from hyperloom import checkpoint as ckpt
from hyperloom.resilience.anomaly import Anomaly, AnomalyDetector
from hyperloom.resilience.events import EventLog
from hyperloom.resilience.inject import FaultInjector
from hyperloom.resilience.lock import RunDirError
from hyperloom.resilience.policy import RecoveryPolicy, TrainingHalted
from hyperloom.resilience.watchdog import (
    RESTARTS_FILE,
    RestartLoopError,
    Watchdog,
    record_start,
    restart_count,
)

if TYPE_CHECKING:
    from hyperloom.config import JobConfig
    from hyperloom.parallel.mesh import ParallelMesh

log = logging.getLogger("hyperloom.resilience")


class GuardedRun(Protocol):
    """What the guard needs of the training run it protects (the trainer implements it)."""

    @property
    def cfg(self) -> JobConfig: ...

    @property
    def mesh(self) -> ParallelMesh: ...

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        ...

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint this run resumed from, if any."""
        ...

    def local_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters (fault drills poison their gradients)."""
        ...

    def load_checkpoint(self, path: Path) -> None:
        """Restore everything a verified checkpoint holds (a collective)."""
        ...

    def data_position(self) -> dict[str, Any]:
        """Where the training data stands (the data loader's state)."""
        ...

    def set_data_position(self, position: dict[str, Any]) -> None: ...

    def barrier(self) -> None:
        """Wait for every rank (nothing with one process)."""
        ...

    def synchronize(self) -> None:
        """Wait for the accelerator's queued work (device-to-host copies of a save)."""
        ...


class Guard:
    def __init__(self, run: GuardedRun) -> None:
        self.run = run
        r, c = run.cfg.resilience, run.cfg.checkpoint
        self.cfg = r
        self.run_dir = Path(run.cfg.logging.run_dir)
        mesh = run.mesh
        self.main, self.world = mesh.is_main, mesh.world_size
        self.lr_scale = 1.0  # lowered by rollbacks (resilience.lr_factor)
        self.events = EventLog(self.run_dir, enabled=self.main)
        self.detector = AnomalyDetector(r.window, r.sigma, r.max_factor, r.warmup)
        self.policy = RecoveryPolicy(
            r.on_anomaly, r.stable_steps, r.max_rollbacks, r.rollback_window, r.max_skips
        )
        self.inject = FaultInjector(r.inject, self.run_dir, mesh.global_rank)
        self.writer = ckpt.open_writer(
            c.format, self.run_dir, c.keep, c.async_save, self._save_failed
        )
        self.watchdog = Watchdog(r.watchdog_s, self.run_dir, mesh.global_rank, self._hung)
        self._pending: tuple[Anomaly, str, int | None] | None = None
        self.save_error: str | None = None  # a save that failed twice, seen by `close`

    # ------------------------------------------------------------------ checks

    def inject_grads(self, step: int, loss: torch.Tensor) -> None:
        self.inject.grads(step, self.run.local_parameters(), loss)

    def healthy(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Check step `step`'s loss and grad norm; False = do not apply this update."""
        if self.cfg.on_anomaly == "none":
            return True
        loss_v, norm_v = self._read(loss, grad_norm)
        anomaly = self.detector.check(step, loss_v, norm_v)
        if anomaly is None:
            self.policy.healthy_step()
            return True
        self.events.emit("anomaly", anomaly.detail, **anomaly.as_record())
        committed = []
        if self.cfg.on_anomaly == "rollback" or self.policy.escalates():
            committed = self._rollback_targets(step)
        action, target = self.policy.decide(anomaly, committed)
        if action == "skip":
            why = ""
            if self.cfg.on_anomaly == "rollback":
                why = (
                    f" (no stable checkpoint yet: none followed by {self.cfg.stable_steps} "
                    f"healthy steps)"
                )
            self.events.emit("skip", f"dropped the update of step {step}{why}", step=step)
            return False
        if self.cfg.on_anomaly == "skip" and action in ("rollback", "skips_exhausted"):
            self.events.emit(
                "escalate",
                f"{self.cfg.max_skips} updates in a row were skipped: "
                + (f"rolling back to step {target}" if target is not None else "stopping"),
                step=step,
            )
        self._pending = (anomaly, action, target)
        return False

    def _rollback_targets(self, step: int) -> list[int]:
        """The committed checkpoints a rollback at `step` may choose from, the same on every
        rank (the main rank, the writer, looks): the in-flight save is waited for, and a
        stable candidate whose files no longer match their SHA-256 is passed over (an
        event), never loaded. A save found lost meanwhile stops the run on every rank."""
        committed, rejected, lost = [], [], None
        try:
            self.writer.wait()  # the newest checkpoint may still be in flight
        except ckpt.CheckpointError as exc:
            lost = str(exc)
        if self.main and lost is None:
            committed = self._committed()
            while (target := self.policy.stable_checkpoint(committed, step - 1)) is not None:
                try:
                    ckpt.verify_checkpoint(ckpt.checkpoint_dir(self.run_dir, target))
                    break
                except ckpt.CheckpointError as exc:
                    rejected.append(str(exc))
                    committed.remove(target)
        if self.world > 1:
            box = [(committed, rejected, lost)]
            dist.broadcast_object_list(box, src=0)
            committed, rejected, lost = box[0]
        if lost is not None:
            raise ckpt.CheckpointError(lost)
        for why in rejected:
            self.events.emit("checkpoint_fallback", f"not rolling back to {why}", step=step)
        return committed

    def check_final(self, step: int, val_loss: float) -> None:
        """The run's end: a non-finite validation loss means non-finite weights, whatever the
        policy (with `on_anomaly = "none"` nothing caught it before); stop before the final
        checkpoint rather than finish "successfully"."""
        if math.isfinite(val_loss):
            return
        msg = (
            f"stopped at step {step}: the final validation loss is {val_loss} (the weights are "
            "not finite); the final checkpoint was not written. Lower train.lr or resume from "
            "an earlier checkpoint"
        )
        self.events.emit("stop", msg, level=logging.ERROR, step=step)
        raise TrainingHalted(msg)

    def _read(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float]:
        """(loss, grad norm) as floats, the same on every rank: one host sync per step."""
        vals = torch.stack([loss.detach().double().reshape(()), grad_norm.double().reshape(())])
        if self.world > 1:
            # NaN does not survive a max reliably: carry "not finite" as a flag instead.
            bad = (~torch.isfinite(vals)).double()
            packed = torch.cat([torch.nan_to_num(vals, nan=0.0, posinf=0.0, neginf=0.0), bad])
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
            vals = torch.where(packed[2:] > 0, float("nan"), packed[:2])
        loss_v, norm_v = vals.tolist()
        return loss_v, norm_v

    def after_step(self) -> None:
        """Act on a pending rollback or stop; drilled crashes and hangs; heartbeat."""
        if self._pending is not None:
            anomaly, action, target = self._pending
            self._pending = None
            if action == "stop":
                msg = (
                    f"stopped at step {anomaly.step} (resilience.on_anomaly = 'stop'): "
                    f"{anomaly.detail}; the update was not applied and nothing after step "
                    f"{anomaly.step - 1} was checkpointed"
                )
                self.events.emit("stop", msg, level=logging.ERROR, step=anomaly.step)
                raise TrainingHalted(msg)
            if action == "skips_exhausted":
                msg = self.policy.skips_exhausted_report(anomaly)
                self.events.emit("stop", msg, level=logging.ERROR, step=anomaly.step)
                raise TrainingHalted(msg)
            if action == "give_up":
                report = self.policy.give_up_report(anomaly)
                self.events.emit("give_up", report, level=logging.ERROR, step=anomaly.step)
                raise TrainingHalted(report)
            assert target is not None
            self._rollback(anomaly, target)
        step = self.run.step
        self.watchdog.heartbeat(step)
        self.inject.after_step(step)

    def _rollback(self, anomaly: Anomaly, target: int) -> None:
        run = self.run
        path = ckpt.checkpoint_dir(self.run_dir, target)
        past_window = run.data_position()  # the loader stands just after the bad window
        run.load_checkpoint(path)  # also restores lr_scale, saved with the guard's state
        skipped = anomaly.step - target
        run.set_data_position(past_window)
        self.lr_scale *= self.cfg.lr_factor
        abandoned = [
            p for p in ckpt.list_checkpoints(self.run_dir) if ckpt.checkpoint_step(p) > target
        ]
        run.barrier()  # every rank has read the target before any of it is deleted
        if self.main:
            for p in abandoned:
                shutil.rmtree(p, ignore_errors=True)
        self.events.emit(
            "rollback",
            f"anomaly at step {anomaly.step} ({anomaly.kind}): back to the stable checkpoint "
            f"of step {target}, skipping the {skipped} batches of steps {target + 1}..."
            f"{anomaly.step}; learning rate x {self.lr_scale:g}"
            + (f"; dropped newer checkpoints {[p.name for p in abandoned]}" if abandoned else ""),
            step=anomaly.step,
            target=target,
            skipped_batches=skipped,
            lr_scale=self.lr_scale,
        )

    # ------------------------------------------------------------------ checkpoints

    def save(
        self,
        step: int,
        model_state: dict[str, torch.Tensor],
        train_state: dict[str, Any],
        extra_files: dict[str, str | bytes],
        meta: dict[str, Any],
        wait: bool = False,
    ) -> Path:
        """Write (main rank) a checkpoint; `wait` = return only once it is committed."""
        stable = self.policy.stable_checkpoint(self._committed(), step)
        path = self.writer.save(
            step,
            model_state,
            train_state,
            extra_files,
            meta,
            protect=frozenset() if stable is None else frozenset([stable]),
            after_first_file=self.inject.save_fault(step),
            synchronize=self.run.synchronize,
        )
        if wait:
            self.writer.wait()
        self.watchdog.heartbeat()
        return path

    def _committed(self) -> list[int]:
        return ckpt.committed_steps(self.run_dir)

    def newest_good(self) -> str:
        """Which checkpoint a stopped run leaves to resume from, in words."""
        try:
            steps = self._committed()
        except ckpt.CheckpointError:
            return "the checkpoints cannot be listed"
        return (
            f"the newest good checkpoint is step {steps[-1]}"
            if steps
            else "there is no good checkpoint yet"
        )

    def may_save(self, step: int, nonfinite: list[str], final: bool) -> bool:
        """Whether the state of step `step` may be checkpointed (a collective): no rank holds
        a NaN or an infinity in its parameters or optimizer state (`nonfinite`: this rank's
        offending tensors, `ckpt.nonfinite_state`). A refused save is an event, never a
        checkpoint; refusing the final one (`final`) stops the run."""
        bad = list(nonfinite)
        if self.world > 1:
            everyone: list[Any] = [None] * self.world
            dist.all_gather_object(everyone, bad)
            bad = [name for names in everyone for name in names]
        if not bad:
            return True
        names = ", ".join(dict.fromkeys(bad[:3]))
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        msg = (
            f"checkpoint step {step} was not written: the parameters or optimizer state hold "
            f"NaN or Inf ({names}{more}); {self.newest_good()}"
        )
        if final:
            msg += ". Lower train.lr or resume from that checkpoint"
        self.events.emit("checkpoint_refused", msg, level=logging.ERROR, step=step)
        if final:
            raise TrainingHalted(msg)
        return False

    def _save_failed(self, step: int, exc: BaseException, committed: bool) -> None:
        """A save failed (the writer reports it at the next save or wait). The writer retried
        it once: if the retry committed, that is an event; otherwise the checkpoint is lost
        and the run stops, rather than train on with nothing to resume from."""
        reason = ckpt.describe_failure(exc)
        if committed:
            self.events.emit(
                "checkpoint_failed",
                f"writing the checkpoint of step {step} failed ({reason}); the retry committed it",
                step=step,
            )
            return
        msg = (
            f"checkpoint step {step} could not be written to "
            f"{ckpt.checkpoint_root(self.run_dir)}: {reason}; {self.newest_good()}"
        )
        try:
            self.events.emit("checkpoint_failed", msg, level=logging.ERROR, step=step)
        except Exception:  # noqa: BLE001 - the run directory is on the same failing disk
            pass  # (events.log, metrics.jsonl); the message ends the run below all the same
        raise ckpt.CheckpointError(msg)

    def latest_checkpoint(self) -> Path | None:
        """Newest committed checkpoint that verifies; each one passed over is an event. The
        main rank reads and hashes the files and tells the others (a collective)."""
        path, rejected, error = None, [], None
        if self.main:
            try:
                path, rejected = ckpt.latest_verified(self.run_dir)
            except ckpt.CheckpointError as exc:  # the checkpoints directory is unreadable
                error = str(exc)
        if self.world > 1:
            box = [(path, rejected, error)]
            dist.broadcast_object_list(box, src=0)
            path, rejected, error = box[0]
        if error is not None:
            raise ckpt.CheckpointError(error)
        for why in rejected:
            self.events.emit(
                "checkpoint_fallback",
                f"not loading {why}; using {path.name if path else 'no checkpoint (fresh start)'}",
            )
        return path

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr_scale": self.lr_scale,
            "detector": self.detector.state_dict(),
            "skips": self.policy.skips,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr_scale = state.get("lr_scale", 1.0)
        self.policy.skips = state.get("skips", 0)
        if "detector" in state:
            self.detector.load_state_dict(state["detector"])

    # ------------------------------------------------------------------ lifetime

    def start(self, step: int) -> None:
        """After resuming: restart-loop guard (main rank decides for all), then the watchdog."""
        reason = None
        if self.main:
            try:
                record = record_start(self.run_dir, step, self.cfg.max_stalled_restarts)
            except OSError as exc:  # a full or read-only run directory
                path = self.run_dir / RESTARTS_FILE
                raise RunDirError(f"cannot write {path}: {exc.strerror or exc}") from None
            reason = record["gave_up"]
        if restart_count() > 0:
            where = self.run.resumed_from
            self.events.emit(
                "restart",
                f"restart {restart_count()}: resumed from "
                f"{where.name if where else 'scratch'} at step {step}",
                step=step,
                restart=restart_count(),
            )
        if self.world > 1:
            box = [reason]
            dist.broadcast_object_list(box, src=0)
            reason = box[0]
        if reason:
            self.events.emit("give_up", reason, level=logging.ERROR, step=step)
            raise RestartLoopError(reason)
        self.watchdog.start()

    def _hung(self, step: int | None, idle: float, stacks: Path) -> None:
        self.events.emit(
            "hang",
            f"no progress for {idle:.1f} s after step {step}; stacks in {stacks.name}; exiting",
            level=logging.ERROR,
            step=step,
        )

    def attach(self, sink) -> None:
        self.events.attach(sink)

    def close(self) -> None:
        """Stop the watchdog and wait for an in-flight save. A save that could not be written
        is an event, and its message stays in `save_error`: the trainer stops on it."""
        self.watchdog.stop()
        try:
            self.writer.wait()
        except ckpt.CheckpointError as exc:
            self.save_error = str(exc)
        self.events.attach(None)
