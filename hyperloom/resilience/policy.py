"""Recovery policy: what to do about an anomalous step, and when to give up.

`resilience.on_anomaly`: **skip** drops the update (OLMo-core's skip-step, torchft's discarded
step), escalating after `max_skips` in a row; **rollback** restores the last stable checkpoint
(followed by `stable_steps` healthy steps), skips the data window that led to the anomaly and
may scale the learning rate -- PaLM restarted before a spike and skipped batches, since a
spike comes from a data window meeting a parameter state; **stop** ends the run. After
`max_rollbacks` within `rollback_window` steps the run gives up with a report instead of
looping. Checkpoints newer than a rollback target are deleted, so a crash right after cannot
resume into the abandoned timeline; pruning never deletes the newest stable checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyperloom.resilience.anomaly import Anomaly


class TrainingHalted(RuntimeError):
    """The run stopped on purpose: an anomaly under on_anomaly = 'stop', or too many
    rollbacks. The message is the report."""


@dataclass
class RecoveryPolicy:
    action: str  # skip | rollback | stop | none
    stable_steps: int
    max_rollbacks: int
    rollback_window: int
    max_skips: int = 0  # consecutive skips before escalating (0: never, for action "rollback")
    skips: int = 0  # updates skipped in a row so far
    anomalies: list[int] = field(default_factory=list)  # steps, this timeline
    rollbacks: list[tuple[int, int]] = field(default_factory=list)  # (anomaly step, target)

    def stable_checkpoint(self, committed: list[int], now: int) -> int | None:
        """Newest checkpoint step that `stable_steps` healthy steps followed by step `now`."""
        for s in sorted(committed, reverse=True):
            if s + self.stable_steps <= now and not any(
                s < a <= s + self.stable_steps for a in self.anomalies
            ):
                return s
        return None

    def escalates(self) -> bool:
        """Whether the next anomaly makes `skip` roll back or stop (`max_skips` in a row)."""
        return self.action == "skip" and 0 < self.max_skips <= self.skips

    def healthy_step(self) -> None:
        self.skips = 0

    def decide(self, anomaly: Anomaly, committed: list[int]) -> tuple[str, int | None]:
        """("skip" | "rollback" | "stop" | "give_up" | "skips_exhausted", rollback target);
        `committed` matters for "rollback" and for a `skip` that `escalates`."""
        self.anomalies.append(anomaly.step)
        if self.action == "stop":
            return "stop", None
        if self.action == "skip" and not self.escalates():
            self.skips += 1
            return "skip", None
        recent = [a for a, _ in self.rollbacks if a > anomaly.step - self.rollback_window]
        if len(recent) >= self.max_rollbacks:
            return "give_up", None
        target = self.stable_checkpoint(committed, anomaly.step - 1)
        if target is None:
            if self.action == "skip":
                return "skips_exhausted", None
            return "skip", None
        self.skips = 0
        self.rollbacks.append((anomaly.step, target))
        # The steps after the target are replayed on other data: their history is void.
        self.anomalies = [a for a in self.anomalies if a <= target]
        return "rollback", target

    def skips_exhausted_report(self, anomaly: Anomaly) -> str:
        return (
            f"stopped at step {anomaly.step}: {self.max_skips} updates in a row were anomalous "
            f"and skipped (resilience.max_skips = {self.max_skips}), the last: "
            f"{anomaly.detail}; no stable checkpoint to roll back to (one followed by "
            f"{self.stable_steps} healthy steps). Lower train.lr, check the data, or resume "
            "from an earlier checkpoint"
        )

    def give_up_report(self, anomaly: Anomaly) -> str:
        lines = [
            f"gave up at step {anomaly.step}: {anomaly.detail}; this would be rollback "
            f"{len(self.rollbacks) + 1}, more than resilience.max_rollbacks = "
            f"{self.max_rollbacks} within {self.rollback_window} steps. Rollbacks so far:"
        ]
        lines += [f"  anomaly at step {a} -> back to step {t}" for a, t in self.rollbacks]
        lines.append(
            "The fault keeps coming back: inspect events.log and the data around these steps, "
            "lower train.lr, or raise resilience.max_rollbacks."
        )
        return "\n".join(lines)
