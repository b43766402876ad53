"""`hyperloom drill` from the command line (one run, no reference: the drills themselves are
tested in process by test_resilience_recovery/checkpoint and under torchrun by
tests/distributed/test_resilience.py)."""

from __future__ import annotations

import json


def test_nan_drill_from_the_cli_completes_and_reports(tmp_path, tiny_job_args, cli):
    run = tmp_path / "drill"
    args = tiny_job_args(
        tmp_path / "ignored",
        train__steps=12,
        checkpoint__every=2,
        resilience__stable_steps=2,
        resilience__warmup=4,
        resilience__sigma=50,
    )
    proc = cli("drill", "nan", "--at", "7", "--no-reference", "--run-dir", str(run), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run / "drill.json").read_text())
    assert report["passed"] and report["completed"] and report["steps"] == 12
    assert any("[rollback] anomaly at step 7" in e for e in report["events"])
    assert "drill nan@7" in proc.stdout


def test_drill_refuses_a_job_without_checkpoints(tmp_path, tiny_job_args, cli):
    args = tiny_job_args(tmp_path / "ignored", train__steps=12)
    proc = cli("drill", "crash", "--run-dir", str(tmp_path / "d"), *args)
    assert proc.returncode == 1
    assert "drills need periodic checkpoints: add --checkpoint.every N" in proc.stderr
