"""One job per run directory (hyperloom.resilience.lock): the lock, its stale and shared
holders, and `hyperloom train` on a directory that is in use."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from hyperloom.resilience.lock import (
    LOCK_FILE,
    RunDirBusy,
    RunDirError,
    RunDirLock,
    die_with_parent_hook,
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _holder(tmp_path, pid: int) -> None:
    record = {"pid": pid, "host": socket.gethostname(), "since": "2026-01-02 03:04:05"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record) + "\n")


def test_a_second_job_is_refused_with_the_holder_named(tmp_path):
    with RunDirLock(tmp_path).acquire():
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        with pytest.raises(RunDirBusy) as err:
            RunDirLock(tmp_path).acquire()
    assert str(err.value) == (
        f"run directory {tmp_path} is in use by pid {os.getpid()} on host "
        f"{socket.gethostname()} since {record['since']}; stop it or choose another --run-dir"
    )
    # Released: the file is gone and the directory is free again.
    assert not (tmp_path / LOCK_FILE).exists()
    RunDirLock(tmp_path).acquire().release()


def test_a_lock_file_left_by_a_dead_job_is_taken_over(tmp_path, caplog):
    dead = _dead_pid()
    _holder(tmp_path, dead)  # the file, but no flock: its process died
    with caplog.at_level(logging.WARNING, "hyperloom.resilience"):
        lock = RunDirLock(tmp_path).acquire(wait_s=0)
    assert f"taking over the lock left by pid {dead} on host" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_processes_of_an_exited_holder_are_waited_for_then_named(tmp_path):
    # The holder (pid dead) started processes that still hold the lock: here another open
    # file description of this process, released after 0.3 s.
    _holder(tmp_path, _dead_pid())
    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_SH)
    with pytest.raises(RunDirBusy, match=r"\(which has exited; processes it started still run\)"):
        RunDirLock(tmp_path).acquire(wait_s=0.3)
    threading.Timer(0.3, os.close, (fd,)).start()
    RunDirLock(tmp_path).acquire(wait_s=10).release()


def test_workers_hold_the_directory_until_they_exit(tmp_path):
    """A launcher shares its lock with its workers; a restart waits until they are gone."""
    launcher = RunDirLock(tmp_path).acquire()
    launcher.share()
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from hyperloom.resilience.lock import RunDirLock; "
            "RunDirLock.join(sys.argv[1]); print('joined', flush=True); time.sleep(60)",
            str(launcher.path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout.readline().strip() == "joined"
        with pytest.raises(RunDirBusy):
            RunDirLock(tmp_path).acquire(wait_s=0)
        with pytest.raises(RunDirError, match="processes of the previous attempt still hold"):
            launcher.wait_alone(timeout_s=0.3)
        with pytest.raises(RunDirBusy):  # still held (shared) after the failed wait
            RunDirLock(tmp_path).acquire(wait_s=0)
        worker.kill()
        worker.wait()
        launcher.wait_alone(timeout_s=10)
        with pytest.raises(RunDirBusy):
            RunDirLock(tmp_path).acquire(wait_s=0)
    finally:
        worker.kill()
        launcher.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_lock_leaves_a_directory_it_made_as_it_found_it(tmp_path):
    run = tmp_path / "new"
    RunDirLock(run).acquire().release()
    assert not run.exists()


def test_a_child_dies_with_its_parent(tmp_path):
    """PR_SET_PDEATHSIG through `die_with_parent_hook`: SIGKILL of the middle process ends
    the grandchild at once (as a SIGKILL of the launcher ends torchrun's agent)."""
    if die_with_parent_hook() is None:
        pytest.skip("no prctl here")
    code = (
        "import subprocess, sys, time; from hyperloom.resilience.lock import die_with_parent_hook; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "preexec_fn=die_with_parent_hook()); print(p.pid, flush=True); time.sleep(60)"
    )
    middle = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(middle.stdout.readline())
    middle.kill()
    middle.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_a_worker_stops_when_its_parent_dies(tmp_path):
    """`stop_with_parent` in the worker: a SIGKILL of torchrun's agent (the middle process
    here) ends the workers it leaves behind within a second."""
    code = (
        "import os, subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import os, time; "
        "from hyperloom.resilience.lock import stop_with_parent; "
        "stop_with_parent(int(os.environ[\\'PARENT\\'])); time.sleep(60)'], "
        "env={**os.environ, 'PARENT': str(os.getpid())}); print(p.pid, flush=True); time.sleep(60)"
    )
    middle = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(middle.stdout.readline())
    middle.kill()  # at once: the child may not be watching yet, and must still stop
    middle.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper has finished)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_train_on_a_directory_in_use_fails_at_once_with_one_line(tmp_path, tiny_job_args, cli):
    run = tmp_path / "run"
    with RunDirLock(run).acquire():
        since = json.loads((run / LOCK_FILE).read_text())["since"]
        proc = cli("train", *tiny_job_args(run, parallel__dp=2), "--nproc", "2")
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]  # nothing else written
        proc1 = cli("train", *tiny_job_args(run, train__steps=2))
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
    line = (
        f"hyperloom train: error: run directory {run} is in use by pid {os.getpid()} on host "
        f"{socket.gethostname()} since {since}; stop it or choose another --run-dir"
    )
    for p in (proc, proc1):
        assert (p.returncode, p.stderr.strip().splitlines()) == (2, [line])
