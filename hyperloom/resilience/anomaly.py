"""Anomaly detection: NaN/Inf, loss spikes and gradient-norm spikes, checked every step.

A step is anomalous when its loss or global grad norm is not finite (always checked, as
Megatron's `--check-for-nan-in-loss-and-grad`), or, after `warmup` healthy steps, spikes:
above mean + sigma * std of the last `window` healthy values (OLMo-core's skip-step rule) or
above `max_factor` times their maximum (Megatron's `SPIKY_LOSS_FACTOR`). Only upward
deviations count, and anomalous values never enter the statistics. The check costs one host
sync per step (after one small all-reduce, so every rank decides alike); OLMo-core avoids it
with an on-device mask, but a rollback is a host decision and must precede the optimizer step.
References: PaLM (arXiv 2204.02311 §5.1); OLMo-core `optim/skip_step_optimizer.py`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Anomaly:
    """What was wrong at one step, in words a person can act on."""

    step: int
    kind: str  # "nonfinite" | "loss_spike" | "grad_spike"
    metric: str  # "loss" | "grad_norm"
    value: float
    threshold: float | None
    detail: str

    def as_record(self) -> dict[str, object]:
        return {
            "step": self.step,
            "kind": self.kind,
            "metric": self.metric,
            "value": self.value if math.isfinite(self.value) else str(self.value),
            "threshold": self.threshold,
            "detail": self.detail,
        }


class RunningStats:
    """Mean, standard deviation and maximum of the last `window` values."""

    def __init__(self, window: int) -> None:
        if window < 2:
            raise ValueError(f"the statistics window must hold at least 2 values, got {window}")
        self.values: deque[float] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self.values)

    def add(self, value: float) -> None:
        self.values.append(value)

    def mean_std_max(self) -> tuple[float, float, float]:
        n = len(self.values)
        mean = sum(self.values) / n
        var = sum((v - mean) ** 2 for v in self.values) / max(n - 1, 1)
        return mean, math.sqrt(var), max(self.values)


class AnomalyDetector:
    """Flags NaN/Inf at once and spikes after a warm-up of healthy steps.

    `check(step, loss, grad_norm)` returns the first anomaly found (NaN/Inf before spikes, loss
    before grad norm) or None, and feeds healthy values into the running statistics.
    """

    def __init__(
        self,
        window: int = 128,
        sigma: float = 6.0,
        max_factor: float = 10.0,
        warmup: int = 64,
    ) -> None:
        if sigma <= 0 or max_factor <= 1:
            raise ValueError(
                f"need sigma > 0 and max_factor > 1, got sigma={sigma}, max_factor={max_factor}"
            )
        self.sigma, self.max_factor, self.warmup = sigma, max_factor, warmup
        self.stats = {"loss": RunningStats(window), "grad_norm": RunningStats(window)}

    def check(self, step: int, loss: float, grad_norm: float) -> Anomaly | None:
        values = {"loss": loss, "grad_norm": grad_norm}
        for metric, value in values.items():
            if not math.isfinite(value):
                return Anomaly(
                    step, "nonfinite", metric, value, None, f"{metric} is {value} at step {step}"
                )
        for metric, value in values.items():
            found = self._spike(step, metric, value)
            if found is not None:
                return found
        for metric, value in values.items():
            self.stats[metric].add(value)
        return None

    def _spike(self, step: int, metric: str, value: float) -> Anomaly | None:
        stats = self.stats[metric]
        if len(stats) < max(self.warmup, 2):
            return None
        mean, std, top = stats.mean_std_max()
        kind = "loss_spike" if metric == "loss" else "grad_spike"
        band = mean + self.sigma * std
        if value > band:
            return Anomaly(
                step,
                kind,
                metric,
                value,
                band,
                f"{metric} {value:.4g} at step {step} exceeds mean + {self.sigma:g} sigma = "
                f"{mean:.4g} + {self.sigma:g} x {std:.3g} = {band:.4g} over the last "
                f"{len(stats)} healthy steps",
            )
        ceiling = self.max_factor * top
        if value > ceiling:
            return Anomaly(
                step,
                kind,
                metric,
                value,
                ceiling,
                f"{metric} {value:.4g} at step {step} exceeds {self.max_factor:g} x the "
                f"running maximum {top:.4g} = {ceiling:.4g}",
            )
        return None

    def state_dict(self) -> dict[str, list[float]]:
        return {k: list(s.values) for k, s in self.stats.items()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        for k, values in state.items():
            self.stats[k].values.clear()
            self.stats[k].values.extend(values)
