"""`hyperloom drill` from the command line (mostly without the reference run: the drills
themselves are tested in process by test_resilience_recovery/checkpoint and under torchrun by
tests/distributed/test_resilience.py)."""

from __future__ import annotations

import json

import pytest


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


def test_writer_crash_drill_retries_the_save_and_survives_a_later_crash(
    tmp_path, tiny_job_args, cli
):
    run = tmp_path / "drill"
    args = tiny_job_args(tmp_path / "ignored", train__steps=10, checkpoint__every=2)
    proc = cli("drill", "writer_crash", "--at", "4", "--no-reference", "--run-dir", str(run), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run / "drill.json").read_text())
    assert report["passed"] and report["completed"] and report["event_seen"]
    failed, *passed_over, restart = report["events"]
    assert failed.startswith("step 4 [checkpoint_failed] writing the checkpoint of step 4 failed")
    assert "WriterCrash" in failed and failed.endswith("; the retry committed it")
    # Step 4's checkpoint is the retry's. On a loaded machine the crash after step 7 can come
    # before step 6's save is committed: the restart then passes over it to step 4.
    if "resumed from step_00000006 " in restart:
        assert passed_over == []
    else:
        assert "[restart] restart 1: resumed from step_00000004 " in restart
        for line in passed_over:
            assert line.startswith("[checkpoint_fallback] not loading step_00000006.tmp"), line


@pytest.mark.slow
def test_uncommitted_latest_drill_falls_back_and_ends_bitwise(tmp_path, tiny_job_args, cli):
    run = tmp_path / "drill"
    args = tiny_job_args(tmp_path / "ignored", train__steps=10, checkpoint__every=2)
    proc = cli("drill", "uncommitted_latest", "--at", "4", "--run-dir", str(run), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run / "drill.json").read_text())
    assert report["damage"] == "deleted the commit record checkpoints/step_00000004/meta.json"
    assert report["passed"] and report["weights_bitwise_equal"]
    assert report["events"] == [
        "[checkpoint_fallback] not loading step_00000004 is not committed (no meta.json): its "
        "commit record is gone; using step_00000002"
    ]


def test_writer_crash_drill_needs_room_for_the_later_crash(tmp_path, tiny_job_args, cli):
    args = tiny_job_args(tmp_path / "ignored", train__steps=8, checkpoint__every=2)
    proc = cli("drill", "writer_crash", "--at", "6", "--run-dir", str(tmp_path / "d"), *args)
    assert proc.returncode == 1
    assert "crashes the process after step 6 + 2 + 1 = 9" in proc.stderr
