"""One job per run directory, and no process of a job outliving it.

**The lock.** Two jobs in one run directory both write checkpoints, rotate each other's and
interleave their metrics. So a job holds an advisory lock, `flock(2)` on `RUN_DIR/.lock`, for
its whole life: the launcher of `hyperloom train --nproc N` across all its `--max-restarts`
attempts, or the single process of `hyperloom train`. The file names the holder (pid, host,
start time) for the message a second job prints before it leaves with exit status 2. The
kernel drops a flock when the last process holding it dies, however it dies, so a lock file
left behind by a killed job does not block: the next job takes it over and says so.

The launcher takes the lock exclusively, writes its name, then shares it: each worker it
starts joins with a shared lock (`HYPERLOOM_RUN_LOCK` names the file), so the directory stays
in use while any process of the job lives, orphans included. Before a restart the launcher
waits until it is the only holder again, so two attempts never overlap. Under a plain
`torchrun -m hyperloom train` (one node or several, the run directory shared) global rank 0
holds the lock for the job; on NFS, Linux maps flock onto the server's byte-range locks. A
filesystem without locks gets a warning and no lock.

**Orphans.** A SIGKILL of the launcher would leave torchrun's agent and its workers running
(torchrun starts workers in their own sessions, out of reach of the terminal's signals). The
launcher starts the agent with `PR_SET_PDEATHSIG` = SIGTERM, on which the agent stops its
workers; and each worker watches its parent (`stop_with_parent`), so a SIGKILL of the agent
itself ends the workers within a second as well.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("hyperloom.resilience")

LOCK_FILE = ".lock"
LOCK_ENV = "HYPERLOOM_RUN_LOCK"  # the lock file a launcher's workers join
AGENT_ENV = "HYPERLOOM_AGENT_PID"  # the parent a launcher's workers must have
STALE_WAIT_S = 30.0  # how long to wait for the processes of a holder that has exited
PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


class RunDirError(RuntimeError):
    """The run directory cannot be used (the message says why)."""


class RunDirBusy(RunDirError):
    """Another job holds the run directory."""


def lock_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir).absolute() / LOCK_FILE


class RunDirLock:
    """The lock on one run directory; `acquire` it (exclusive) or `join` a launcher's."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir).absolute()
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._owner = False  # wrote the holder record; unlinks the file on release
        self._made_dir = False

    # ------------------------------------------------------------------ taking it

    def acquire(self, wait_s: float = STALE_WAIT_S) -> RunDirLock:
        """Hold the run directory exclusively, or raise RunDirBusy. A holder on this host
        that has exited but whose processes still hold the lock (workers being stopped)
        is waited for, up to `wait_s` seconds."""
        if not self.run_dir.exists():
            self._made_dir = True
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"cannot create the run directory {self.run_dir}: {exc}") from None
        deadline, said = time.monotonic() + wait_s, False
        while True:
            fd = self._open()
            try:
                if not self._lock(fd, fcntl.LOCK_EX):
                    return self
            except BlockingIOError:
                os.close(fd)
                holder = self.holder()
                if not _exited_here(holder) or time.monotonic() > deadline:
                    raise RunDirBusy(self._busy(holder)) from None
                if not said:
                    said = True
                    log.warning(
                        "run directory %s: its holder (pid %s) has exited and the processes it "
                        "started are stopping; waiting up to %.0f s",
                        self.run_dir,
                        holder.get("pid"),
                        wait_s,
                    )
                time.sleep(0.2)
                continue
            if not self._same_file(fd):  # the holder released (unlinked) it meanwhile
                os.close(fd)
                continue
            break
        self._fd, self._owner = fd, True
        stale = self.holder()
        if stale:
            log.warning(
                "run directory %s: taking over the lock left by pid %s on host %s since %s "
                "(that job is gone)",
                self.run_dir,
                stale.get("pid", "?"),
                stale.get("host", "?"),
                stale.get("since", "?"),
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return self

    @classmethod
    def join(cls, path: str | os.PathLike) -> RunDirLock:
        """A worker's shared hold on the lock its launcher took (`LOCK_ENV`)."""
        lock = cls(Path(path).parent)
        fd = lock._open()
        try:
            if not lock._lock(fd, fcntl.LOCK_SH):
                return lock
        except BlockingIOError:
            os.close(fd)
            raise RunDirBusy(lock._busy(lock.holder())) from None
        lock._fd = fd
        return lock

    def share(self) -> None:
        """Let this job's workers join (exclusive -> shared; a downgrade never waits)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_SH)

    def wait_alone(self, timeout_s: float = STALE_WAIT_S) -> None:
        """Return once no other process holds the lock (the previous attempt's workers have
        all exited), still holding it shared; RunDirError after `timeout_s`."""
        if self._fd is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:  # a failed upgrade drops the shared lock: take it back below
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(self._fd, fcntl.LOCK_SH)
                return
            except BlockingIOError:
                pass
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # another job took it in that instant
                raise RunDirBusy(self._busy(self.holder())) from None
            if time.monotonic() > deadline:
                raise RunDirError(
                    f"processes of the previous attempt still hold {self.run_dir} after "
                    f"{timeout_s:.0f} s; stop them (see `fuser {self.path}`) and start again"
                )
            time.sleep(0.2)

    # ------------------------------------------------------------------ letting go

    def release(self) -> None:
        """Let go. The holder removes the lock file (and the run directory if it made it and
        nothing else is in it) once no other process holds it. A worker's shared hold lasts
        until its process ends: a rank that fails still tears down (an async save, say) after
        the exception has left its `with` block, and the launcher waits for that."""
        if not self._owner:
            return
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self._same_file(fd):
                    self.path.unlink()
                if self._made_dir:
                    with contextlib.suppress(OSError):
                        self.run_dir.rmdir()  # only if empty
        finally:
            os.close(fd)

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ------------------------------------------------------------------ helpers

    def holder(self) -> dict[str, Any]:
        """The holder record in the lock file ({} if none or unreadable)."""
        try:
            data = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _busy(self, holder: dict[str, Any]) -> str:
        pid, host, since = (holder.get(k, "?") for k in ("pid", "host", "since"))
        gone = " (which has exited; processes it started still run)" if _exited_here(holder) else ""
        return (
            f"run directory {self.run_dir} is in use by pid {pid}{gone} on host {host} since "
            f"{since}; stop it or choose another --run-dir"
        )

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise RunDirError(f"cannot create the lock file {self.path}: {exc}") from None

    def _lock(self, fd: int, op: int) -> bool:
        """flock(fd, op | LOCK_NB): True when held, False (and fd closed) where the
        filesystem has no locks; BlockingIOError when another process holds it."""
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
        except BlockingIOError:
            raise
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.close(fd)
            log.warning(
                "run directory %s: the filesystem does not support locks (%s); running without "
                "the one-job-per-directory guard",
                self.run_dir,
                exc.strerror,
            )
            return False
        return True

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False


def hold_run_dir(run_dir: str | os.PathLike) -> contextlib.AbstractContextManager:
    """This training process's hold on its run directory: a worker of `hyperloom train
    --nproc N` joins its launcher's lock; a single process, or global rank 0 under a plain
    torchrun, takes it; the other ranks of a plain torchrun job rely on rank 0's. A torchrun
    worker also stops when its parent (torchrun's agent) dies."""
    if "LOCAL_RANK" in os.environ:
        stop_with_parent(int(os.environ.get(AGENT_ENV, "0")) or None)
    joined = os.environ.get(LOCK_ENV)
    if joined and joined == str(lock_path(run_dir)):
        return RunDirLock.join(joined)
    if int(os.environ.get("RANK", "0")) == 0:
        return RunDirLock(run_dir).acquire()
    return contextlib.nullcontext()


def _exited_here(holder: dict[str, Any]) -> bool:
    """Whether the holder ran on this host and its process is gone."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


# ---------------------------------------------------------------------- parent death


def stop_with_parent(parent: int | None = None, poll_s: float = PARENT_POLL_S) -> None:
    """End this process when its parent dies: a daemon thread compares os.getppid() with
    `parent` (by default the parent now; an orphan is re-parented to init or a subreaper)
    every `poll_s` seconds and leaves with `os._exit`, as a kill would. Naming the parent
    catches one that died before this call."""
    parent = parent or os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                log.error(
                    "the launcher of this process (pid %d) is gone; stopping rank %s",
                    parent,
                    os.environ.get("RANK", "0"),
                )
                logging.shutdown()
                os._exit(1)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="hyperloom-parent-watch", daemon=True).start()


def die_with_parent_hook(sig: int = signal.SIGTERM):
    """A `preexec_fn` for subprocess: the child gets `sig` when this process dies (Linux
    PR_SET_PDEATHSIG, kept across exec), or None where that is not available. Resolved
    here, before the fork, so the child only calls into libc."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call
            os.kill(os.getpid(), sig)

    return hook
