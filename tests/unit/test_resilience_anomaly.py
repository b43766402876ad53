"""Anomaly detection and the recovery policy on synthetic series (no training)."""

from __future__ import annotations

import math
import random

import pytest

from hyperloom.config import parse_inject
from hyperloom.resilience.anomaly import AnomalyDetector
from hyperloom.resilience.policy import RecoveryPolicy


def noisy(n: int, level: float = 3.0, noise: float = 0.05, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [level + rng.gauss(0, noise) for _ in range(n)]


def feed(det: AnomalyDetector, losses, norms=None) -> list:
    norms = norms or [1.0] * len(losses)
    return [det.check(i + 1, a, b) for i, (a, b) in enumerate(zip(losses, norms, strict=True))]


def test_a_clean_noisy_series_raises_nothing():
    det = AnomalyDetector(window=32, sigma=6, max_factor=10, warmup=8)
    assert feed(det, noisy(300)) == [None] * 300


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_is_caught_from_the_first_step(bad):
    det = AnomalyDetector(warmup=64)
    a = det.check(1, bad, 1.0)
    assert a is not None and (a.kind, a.metric) == ("nonfinite", "loss")
    a = det.check(2, 3.0, bad)
    assert a is not None and (a.kind, a.metric) == ("nonfinite", "grad_norm")


def test_loss_spike_after_warmup_only():
    det = AnomalyDetector(window=32, sigma=6, max_factor=10, warmup=16)
    series = noisy(40)
    series[30] = 4.0  # 1 nat above a 0.05-noise series: far beyond 6 sigma
    found = [a for a in feed(det, series) if a is not None]
    assert [(a.step, a.kind) for a in found] == [(31, "loss_spike")]
    assert "mean + 6 sigma" in found[0].detail
    early = noisy(10)
    early[5] = 30.0  # inside the warm-up of 16 healthy steps: not judged
    assert feed(AnomalyDetector(window=32, warmup=16), early) == [None] * 10


def test_grad_norm_spike_and_running_max_factor():
    det = AnomalyDetector(window=16, sigma=1e9, max_factor=10, warmup=4)  # sigma rule off
    norms = [1.0, 2.0, 1.5, 1.0, 1.2, 25.0]
    found = feed(det, [3.0] * 6, norms)
    assert found[:5] == [None] * 5
    assert found[5].kind == "grad_spike" and found[5].threshold == pytest.approx(20.0)
    assert "running maximum" in found[5].detail


def test_anomalies_do_not_enter_the_statistics():
    det = AnomalyDetector(window=32, sigma=6, max_factor=10, warmup=8)
    series = noisy(20) + [50.0, 50.0, 50.0] + noisy(5, seed=1)
    found = feed(det, series)
    assert [i + 1 for i, a in enumerate(found) if a] == [21, 22, 23]  # still caught each time


def test_a_falling_loss_is_not_an_anomaly():
    det = AnomalyDetector(window=32, sigma=3, max_factor=10, warmup=8)
    assert feed(det, [6.0 - 0.01 * i for i in range(50)] + [1.0]) == [None] * 51


def test_detector_state_round_trips():
    a, b = AnomalyDetector(window=8, warmup=4), AnomalyDetector(window=8, warmup=4)
    feed(a, noisy(10))
    b.load_state_dict(a.state_dict())
    assert a.check(11, 9.0, 1.0) == b.check(11, 9.0, 1.0)


def _anomaly(step: int):
    det = AnomalyDetector()
    return det.check(step, math.nan, 1.0)


def test_rollback_targets_the_newest_stable_checkpoint():
    pol = RecoveryPolicy("rollback", stable_steps=3, max_rollbacks=2, rollback_window=100)
    # Checkpoints at 2, 4, 6, 8; anomaly at 9: 8 and 6 lack 3 healthy steps after them (6+3 = 9
    # is the anomalous step itself), so 4 is the newest stable one.
    assert pol.decide(_anomaly(9), [2, 4, 6, 8]) == ("rollback", 4)
    assert pol.stable_checkpoint([2, 4], 7) == 4


def test_rollback_without_stable_checkpoint_skips():
    pol = RecoveryPolicy("rollback", stable_steps=5, max_rollbacks=2, rollback_window=100)
    assert pol.decide(_anomaly(3), [2]) == ("skip", None)


def test_give_up_after_k_rollbacks_in_the_window():
    pol = RecoveryPolicy("rollback", stable_steps=1, max_rollbacks=2, rollback_window=50)
    assert pol.decide(_anomaly(10), [4, 8])[0] == "rollback"
    assert pol.decide(_anomaly(12), [4, 8])[0] == "rollback"
    assert pol.decide(_anomaly(14), [4, 8])[0] == "give_up"
    report = pol.give_up_report(_anomaly(14))
    assert "max_rollbacks = 2" in report and "anomaly at step 10 -> back to step 8" in report
    far = RecoveryPolicy("rollback", stable_steps=1, max_rollbacks=1, rollback_window=5)
    assert far.decide(_anomaly(10), [4, 8])[0] == "rollback"
    assert far.decide(_anomaly(30), [20])[0] == "rollback"  # the first is out of the window


def test_an_anomaly_inside_the_stable_span_disqualifies_a_checkpoint():
    pol = RecoveryPolicy("skip", stable_steps=4, max_rollbacks=2, rollback_window=100)
    pol.decide(_anomaly(7), [4])  # skipped at step 7, 3 steps after the checkpoint at 4
    assert pol.stable_checkpoint([2, 4], 20) == 2


def test_stop_and_skip_policies():
    assert RecoveryPolicy("stop", 1, 1, 1).decide(_anomaly(3), [2]) == ("stop", None)
    assert RecoveryPolicy("skip", 1, 1, 1).decide(_anomaly(3), [2]) == ("skip", None)


def test_inject_specs_are_parsed_and_errors_say_what_is_allowed():
    faults = parse_inject("nan_grad@5, crash@4:r1")
    assert [(f.kind, f.step, f.rank) for f in faults] == [("nan_grad", 5, None), ("crash", 4, 1)]
    assert faults[0].hits(3) and not faults[1].hits(0)
    with pytest.raises(ValueError, match="kind one of nan_grad, loss_spike, crash"):
        parse_inject("nan@x")
