"""Real signals from outside the process: SIGKILL of a worker, of the launcher, and of a
process half-way through a save.

Each fault is timed with an injected pause (`hang@5` stops a rank after step 5,
`stall_save@4` stops the save of step 4 once its first file is on disk), found through the
drill's marker file, then delivered by the test with `os.kill`. Each run must end equal to an
uninterrupted one (final weights bitwise: a resume replays exactly), keep every committed
checkpoint, and leave no process behind (checked in /proc). The tiny job runs 10 steps with
checkpoints every 2 on at most 2 processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hyperloom.resilience.lock import LOCK_FILE

pytestmark = pytest.mark.slow

STEPS = 10
COMMON = dict(train__steps=STEPS, checkpoint__every=2, checkpoint__keep=10)
FINAL = f"checkpoints/step_{STEPS:08d}/model.safetensors"


# ------------------------------------------------------------------------------- helpers


def _launch(args: list[str], log: Path) -> subprocess.Popen:
    """`python -m hyperloom train ARGS` in the background, its output in `log`."""
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "hyperloom", "train", *args], stdout=out, stderr=out
        )


def _job_processes(run_dir: Path) -> dict[int, str | None]:
    """Live processes (zombies are finished) that have `run_dir` on their command line:
    launcher, torchrun agent, workers. pid -> the RANK in their environment, if any."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            if str(run_dir).encode() not in args:
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            env = dict(
                kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0") if kv
            )
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if state != "Z":
            rank = env.get(b"RANK")
            found[int(entry.name)] = rank.decode() if rank is not None else None
    return found


def _wait_for(what: str, ready, timeout: float = 180.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run ended (status {proc.returncode}) before {what}")
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def _fired(run_dir: Path, fault: str) -> bool:
    return any((run_dir / "drills").glob(f"fired.{fault}*"))


def _no_orphans(run_dir: Path, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while _job_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _job_processes(run_dir)
    for pid in left:  # do not leave them to the next test, whatever the verdict
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job outlived it: {left}"


def _stop(proc: subprocess.Popen, run_dir: Path) -> None:
    """After a check failed while the job ran: let none of it run on into the next test."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        for pid in _job_processes(run_dir):
            os.kill(pid, signal.SIGKILL)


def _assert_same_run(run: Path, ref: Path) -> None:
    """Final weights bitwise, and each step's loss (its last record: replayed steps are
    written again) as in the uninterrupted run."""
    a, b = load_file(str(run / FINAL)), load_file(str(ref / FINAL))
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    losses = {}
    for d in (run, ref):
        records = map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
        losses[d] = {r["step"]: r["loss"] for r in records if r["event"] == "train"}
    assert losses[run] == losses[ref]


@pytest.fixture(scope="module")
def dp2_reference(tmp_path_factory, tiny_job_args, cli) -> Path:
    ref = tmp_path_factory.mktemp("signals") / "reference"
    proc = cli("train", *tiny_job_args(ref, parallel__dp=2, **COMMON), "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ref


# ------------------------------------------------------------------------------- the faults


def test_sigkill_of_the_launcher_ends_its_job_and_a_relaunch_resumes(
    tmp_path, tiny_job_args, cli, dp2_reference
):
    run = tmp_path / "run"
    args = [*tiny_job_args(run, parallel__dp=2, **COMMON), "--nproc", "2"]
    args += ["--resilience.inject", "hang@5"]  # rank 0 stops after step 5 (once)
    launcher = _launch(args, tmp_path / "first.log")
    try:
        _wait_for("the hang after step 5", lambda: _fired(run, "hang@5"), proc=launcher)
        # While the job lives, a second one in its run directory is refused at once.
        second = cli("train", *args)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"hyperloom train: error: run directory {run} is in use by pid {launcher.pid} on "
            f"host {json.loads((run / LOCK_FILE).read_text())['host']} since "
            f"{json.loads((run / LOCK_FILE).read_text())['since']}; stop it or choose another "
            f"--run-dir"
        ]
        assert len(_job_processes(run)) == 4  # launcher, torchrun's agent, two workers
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
    finally:
        _stop(launcher, run)
    _no_orphans(run, within=10)
    assert (run / "checkpoints" / "step_00000004" / "meta.json").is_file()

    again = cli("train", *args)  # the same command: takes the lock over and resumes
    assert again.returncode == 0, again.stderr[-3000:]
    assert "taking over the lock left by pid" in again.stderr
    assert "resumed from" in again.stderr and "step_00000004" in again.stderr
    _assert_same_run(run, dp2_reference)
    assert not (run / LOCK_FILE).exists()


def test_sigkill_of_a_worker_is_healed_by_a_restart(tmp_path, tiny_job_args, dp2_reference):
    run = tmp_path / "run"
    args = [*tiny_job_args(run, parallel__dp=2, **COMMON), "--nproc", "2", "--max-restarts", "1"]
    args += ["--resilience.inject", "hang@5:r1"]  # rank 1 stops after step 5 (once)
    launcher = _launch(args, tmp_path / "run.log")
    try:
        _wait_for("the hang after step 5", lambda: _fired(run, "hang@5"), proc=launcher)
        (rank1,) = [pid for pid, rank in _job_processes(run).items() if rank == "1"]
        os.kill(rank1, signal.SIGKILL)
        assert launcher.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        _stop(launcher, run)
    _no_orphans(run, within=5)
    events = (run / "events.log").read_text()
    assert "restart 1: resumed from step_00000004 at step 4" in events
    _assert_same_run(run, dp2_reference)


def test_sigkill_during_a_save_loses_no_checkpoint_and_a_relaunch_resumes(
    tmp_path, tiny_job_args, cli
):
    ref = tmp_path / "reference"
    proc = cli("train", *tiny_job_args(ref, **COMMON))
    assert proc.returncode == 0, proc.stderr[-3000:]

    run = tmp_path / "run"
    args = [*tiny_job_args(run, **COMMON), "--resilience.inject", "stall_save@4"]
    single = _launch(args, tmp_path / "first.log")
    try:
        staging = run / "checkpoints" / "step_00000004.tmp"

        def half_written() -> bool:
            return _fired(run, "stall_save@4") and staging.is_dir() and any(staging.iterdir())

        _wait_for("the stalled save of step 4", half_written, proc=single)
        os.kill(single.pid, signal.SIGKILL)
        single.wait()
    finally:
        _stop(single, run)
    _no_orphans(run, within=5)
    ckpts = run / "checkpoints"
    assert (ckpts / "step_00000002" / "meta.json").is_file()  # the committed one is kept
    assert not (ckpts / "step_00000004").exists()  # the interrupted one never published

    again = cli("train", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "step_00000002" in again.stderr
    _assert_same_run(run, ref)


def test_sigkill_of_a_worker_without_restarts_ends_in_one_line(tmp_path, tiny_job_args):
    run = tmp_path / "run"
    args = [*tiny_job_args(run, parallel__dp=2, **COMMON), "--nproc", "2"]
    args += ["--resilience.inject", "hang@3:r1"]
    launcher = _launch(args, tmp_path / "run.log")
    try:
        _wait_for("the hang after step 3", lambda: _fired(run, "hang@3"), proc=launcher)
        (rank1,) = [pid for pid, rank in _job_processes(run).items() if rank == "1"]
        os.kill(rank1, signal.SIGKILL)
        assert launcher.wait(timeout=120) == 2
    finally:
        _stop(launcher, run)
    _no_orphans(run, within=5)
    last = (tmp_path / "run.log").read_text().strip().splitlines()[-1]
    assert last == (
        f"hyperloom train: error: the process group failed: rank 1 (pid {rank1}) was killed by "
        "SIGKILL; the same command resumes from the newest checkpoint (--max-restarts R "
        "restarts it by itself)"
    )
    assert "ChildFailedError" not in (tmp_path / "run.log").read_text()
    assert (run / "checkpoints" / "step_00000002" / "meta.json").is_file()
    assert not (run / LOCK_FILE).exists()
