"""Recovery drills in one process: NaN and spike roll back, skip, stop, give up.

Each drill is the tiny fp32 job of conftest.tiny_job for 16 steps with a checkpoint every 2;
the fault is injected at step 9. With `stable_steps = 2` the checkpoint at 6 is the newest
stable one then (8 has only step 9 after it). The spike band is set to 50 sigma here: on 16
steps of a tiny model the gradient norm climbs by more than 6 sigma of its short history on
its own, and these tests are about the recovery, not about the detector's threshold
(tests/unit/test_resilience_anomaly.py is).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyperloom.checkpoint import list_checkpoints
from hyperloom.config import load_config
from hyperloom.resilience.events import json_events, read_events
from hyperloom.resilience.policy import TrainingHalted
from hyperloom.train.trainer import Trainer

COMMON = dict(
    train__steps=16,
    checkpoint__every=2,
    resilience__stable_steps=2,
    resilience__warmup=4,
    resilience__window=16,
    resilience__sigma=50,
)


def run(run_dir: Path, tiny_job_args, **overrides) -> dict:
    cfg = load_config(None, tiny_job_args(run_dir, **{**COMMON, **overrides}))
    return Trainer(cfg).run().summary


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_job_args) -> dict:
    return run(tmp_path_factory.mktemp("clean"), tiny_job_args, resilience__on_anomaly="none")


@pytest.mark.parametrize("fault", ["nan_grad@9", "loss_spike@9"])
def test_drill_rolls_back_skips_the_window_and_finishes_close_to_clean(
    fault, clean, tiny_job_args, tmp_path
):
    s = run(tmp_path, tiny_job_args, resilience__on_anomaly="rollback", resilience__inject=fault)
    assert s["steps"] == 16
    (anomaly,) = json_events(tmp_path, "anomaly")
    (rollback,) = json_events(tmp_path, "rollback")
    assert anomaly["step"] == 9
    assert anomaly["kind"] == ("nonfinite" if fault.startswith("nan") else "loss_spike")
    assert (rollback["target"], rollback["skipped_batches"]) == (6, 3)
    log = "\n".join(read_events(tmp_path))
    assert "[rollback] anomaly at step 9" in log and "skipping the 3 batches" in log
    # The run finishes as well as the clean one: validation loss within 2%.
    assert abs(s["final_val_loss"] - clean["final_val_loss"]) < 0.02 * clean["final_val_loss"]
    # The training log shows the replayed steps 7..9 after the rollback.
    steps = [
        r["step"]
        for r in map(json.loads, (tmp_path / "metrics.jsonl").open())
        if r["event"] == "train"
    ]
    assert steps == list(range(1, 10)) + list(range(7, 17))


def test_skip_drops_the_update_and_keeps_the_weights_finite(clean, tiny_job_args, tmp_path):
    s = run(tmp_path, tiny_job_args, resilience__inject="nan_grad@9")  # default: skip
    assert [e["event"] for e in json_events(tmp_path)] == ["anomaly", "skip"]
    assert abs(s["final_val_loss"] - clean["final_val_loss"]) < 0.02 * clean["final_val_loss"]


def test_stop_halts_without_checkpointing_the_bad_step(tiny_job_args, tmp_path):
    with pytest.raises(TrainingHalted, match="stopped at step 9"):
        run(tmp_path, tiny_job_args, resilience__on_anomaly="stop", resilience__inject="nan_grad@9")
    assert list_checkpoints(tmp_path)[-1].name == "step_00000008"
    assert "[stop]" in "\n".join(read_events(tmp_path))


def test_gives_up_after_too_many_rollbacks(tiny_job_args, tmp_path):
    with pytest.raises(TrainingHalted, match="gave up at step 11") as exc:
        run(
            tmp_path,
            tiny_job_args,
            resilience__on_anomaly="rollback",
            resilience__max_rollbacks=1,
            resilience__inject="nan_grad@9,nan_grad@11",
        )
    assert "anomaly at step 9 -> back to step 6" in str(exc.value)
    assert [e["event"] for e in json_events(tmp_path)][-1] == "give_up"


def test_skip_escalates_to_a_rollback_after_max_skips_in_a_row(clean, tiny_job_args, tmp_path):
    s = run(
        tmp_path,
        tiny_job_args,
        resilience__max_skips=2,
        resilience__inject="nan_grad@9,nan_grad@10,nan_grad@11",
    )
    events = [e["event"] for e in json_events(tmp_path)]
    assert events == [
        *["anomaly", "skip"] * 2,
        *["anomaly", "escalate", "rollback"],
    ], events
    rollback = json_events(tmp_path)[-1]
    assert rollback["target"] == 6  # the newest checkpoint that 2 healthy steps followed
    assert abs(s["final_val_loss"] - clean["final_val_loss"]) < 0.02 * clean["final_val_loss"]


def test_skip_stops_when_it_cannot_escalate(tiny_job_args, tmp_path):
    """Anomalies in a row with no checkpoint to roll back to end the run with an error, not
    with a run that skipped its way to the end."""
    with pytest.raises(TrainingHalted, match="3 updates in a row were anomalous") as exc:
        run(
            tmp_path,
            tiny_job_args,
            checkpoint__every=0,
            resilience__inject=",".join(f"nan_grad@{k}" for k in range(3, 17)),
        )
    assert "stopped at step 6" in str(exc.value)
    assert [e["event"] for e in json_events(tmp_path)][-2:] == ["escalate", "stop"]


def test_skips_in_a_row_are_counted_across_a_resume(tiny_job_args, tmp_path):
    s = run(tmp_path, tiny_job_args, train__stop_at_step=10, resilience__inject="nan_grad@10")
    assert s["steps"] == 10
    state = torch.load(list_checkpoints(tmp_path)[-1] / "train_state.pt", weights_only=False)
    assert state["resilience"]["skips"] == 1


def test_a_run_never_finishes_with_non_finite_weights(tiny_job_args, cli, tmp_path):
    """A learning rate that diverges, with the default policy: the run ends with exit 2 and
    one line, and no final checkpoint of non-finite weights is written."""
    result = cli("train", *tiny_job_args(tmp_path, train__lr=1e3, train__steps=30))
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "stopped at step" in last, result.stderr[-2000:]
