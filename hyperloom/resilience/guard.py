"""The trainer's resilience hooks in one object: checks, recovery, saves, watchdog, drills.

The trainer calls a `Guard` at a handful of points and otherwise knows nothing of
resilience:

- `inject_grads` after the backward (fault drills), `healthy` before the optimizer step
  (anomaly detection: False drops the update), `after_step` once the step is counted
  (rollback or stop, drilled crashes and hangs, the watchdog's heartbeat);
- `save` for every checkpoint (synchronous or asynchronous, commit protocol) and
  `latest_checkpoint` when resuming (newest committed and verified, with fallback);
- `start` after resuming (restart-loop guard, watchdog) and `close` at the end.

Every decision is identical on every rank: the checked values are all-reduced first, and
the checkpoint a rollback returns to is chosen from the shared file system by every rank
alike. Only the main rank writes events and checkpoints (with `checkpoint.format = "sharded"`,
every rank writes its own shards and the main rank commits them).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hyperloom.resilience.anomaly import Anomaly, AnomalyDetector
from hyperloom.resilience.checkpoint import CheckpointWriter
from hyperloom.resilience.events import EventLog
from hyperloom.resilience.inject import FaultInjector
from hyperloom.resilience.policy import RecoveryPolicy, TrainingHalted
from hyperloom.resilience.sharded import ShardedCheckpointWriter
from hyperloom.resilience.watchdog import (
    RestartLoopError,
    Watchdog,
    record_start,
    restart_count,
)
from hyperloom.train import checkpoint as ckpt

if TYPE_CHECKING:
    from hyperloom.train.trainer import Trainer

log = logging.getLogger("hyperloom.resilience")


class Guard:
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        r, c = trainer.cfg.resilience, trainer.cfg.checkpoint
        self.cfg = r
        self.run_dir = Path(trainer.cfg.logging.run_dir)
        mesh = trainer.mesh
        self.main, self.world = mesh.is_main, mesh.world_size
        self.events = EventLog(self.run_dir, enabled=self.main)
        self.detector = AnomalyDetector(r.window, r.sigma, r.max_factor, r.warmup)
        self.policy = RecoveryPolicy(
            r.on_anomaly, r.stable_steps, r.max_rollbacks, r.rollback_window
        )
        self.inject = FaultInjector(r.inject, self.run_dir, mesh.global_rank)
        writer = ShardedCheckpointWriter if c.format == "sharded" else CheckpointWriter
        self.writer = writer(self.run_dir, c.keep, c.async_save, self._save_failed)
        self.watchdog = Watchdog(r.watchdog_s, self.run_dir, mesh.global_rank, self._hung)
        self._pending: tuple[Anomaly, str, int | None] | None = None

    # ------------------------------------------------------------------ checks

    def inject_grads(self, step: int, loss: torch.Tensor) -> None:
        params = [p for _, p in self.trainer.pm.local_params()]
        self.inject.grads(step, params, loss)

    def healthy(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Check step `step`'s loss and grad norm; False = do not apply this update."""
        if self.cfg.on_anomaly == "none":
            return True
        loss_v, norm_v = self._read(loss, grad_norm)
        anomaly = self.detector.check(step, loss_v, norm_v)
        if anomaly is None:
            return True
        self.events.emit("anomaly", anomaly.detail, **anomaly.as_record())
        committed = []
        if self.cfg.on_anomaly == "rollback":
            self.writer.wait()  # the newest checkpoint may still be in flight
            committed = self._committed()
            if self.world > 1:  # what the main rank (the writer) sees, for every rank
                box = [committed]
                dist.broadcast_object_list(box, src=0)
                committed = box[0]
        action, target = self.policy.decide(anomaly, committed)
        if action == "skip":
            why = ""
            if self.cfg.on_anomaly == "rollback":
                why = (
                    f" (no stable checkpoint yet: none followed by {self.cfg.stable_steps} "
                    f"healthy steps)"
                )
            self.events.emit("skip", f"dropped the update of step {step}{why}", step=step)
        else:
            self._pending = (anomaly, action, target)
        return False

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
        t = self.trainer
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
            if action == "give_up":
                report = self.policy.give_up_report(anomaly)
                self.events.emit("give_up", report, level=logging.ERROR, step=anomaly.step)
                raise TrainingHalted(report)
            assert target is not None
            self._rollback(anomaly, target)
        self.watchdog.heartbeat(t.step)
        self.inject.after_step(t.step)

    def _rollback(self, anomaly: Anomaly, target: int) -> None:
        t = self.trainer
        path = ckpt.checkpoint_root(self.run_dir) / f"step_{target:08d}"
        past_window = t.loader.state_dict()  # the loader stands just after the bad window
        t.load_checkpoint(path)
        skipped = anomaly.step - target
        t.loader.load_state_dict(past_window)
        t.lr_scale *= self.cfg.lr_factor
        abandoned = [
            p for p in ckpt.list_checkpoints(self.run_dir) if ckpt.checkpoint_step(p) > target
        ]
        t._barrier()  # every rank has read the target before any of it is deleted
        if self.main:
            for p in abandoned:
                shutil.rmtree(p, ignore_errors=True)
        self.events.emit(
            "rollback",
            f"anomaly at step {anomaly.step} ({anomaly.kind}): back to the stable checkpoint "
            f"of step {target}, skipping the {skipped} batches of steps {target + 1}..."
            f"{anomaly.step}; learning rate x {t.lr_scale:g}"
            + (f"; dropped newer checkpoints {[p.name for p in abandoned]}" if abandoned else ""),
            step=anomaly.step,
            target=target,
            skipped_batches=skipped,
            lr_scale=t.lr_scale,
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
            synchronize=self.trainer.acc.synchronize,
        )
        if wait:
            self.writer.wait()
        self.watchdog.heartbeat()
        return path

    def _committed(self) -> list[int]:
        return [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(self.run_dir)]

    def _save_failed(self, step: int, exc: BaseException) -> None:
        self.events.emit(
            "checkpoint_failed",
            f"the checkpoint of step {step} was not committed ({type(exc).__name__}: {exc}); "
            f"the previous committed checkpoint stays the latest",
            level=logging.ERROR,
            step=step,
        )

    def latest_checkpoint(self) -> Path | None:
        """Newest committed checkpoint that verifies; each one passed over is an event. The
        main rank reads and hashes the files and tells the others (a collective)."""
        path, rejected = ckpt.latest_verified(self.run_dir) if self.main else (None, [])
        if self.world > 1:
            box = [(path, rejected)]
            dist.broadcast_object_list(box, src=0)
            path, rejected = box[0]
        for why in rejected:
            self.events.emit(
                "checkpoint_fallback",
                f"not loading {why}; using {path.name if path else 'no checkpoint (fresh start)'}",
            )
        return path

    def state_dict(self) -> dict[str, Any]:
        return {"lr_scale": self.trainer.lr_scale, "detector": self.detector.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.lr_scale = state.get("lr_scale", 1.0)
        if "detector" in state:
            self.detector.load_state_dict(state["detector"])

    # ------------------------------------------------------------------ lifetime

    def start(self, step: int) -> None:
        """After resuming: restart-loop guard (main rank decides for all), then the watchdog."""
        reason = None
        if self.main:
            reason = record_start(self.run_dir, step, self.cfg.max_stalled_restarts)["gave_up"]
        if restart_count() > 0:
            where = self.trainer.resumed_from
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
        """Stop the watchdog and wait for an in-flight save (errors become events)."""
        self.watchdog.stop()
        self.writer.wait()
        self.events.attach(None)
