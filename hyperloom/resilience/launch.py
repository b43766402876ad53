"""`hyperloom train --nproc N [--max-restarts R]`: torchrun on this machine, restarted whole.

A failed group (a rank crashed or was killed, or its watchdog ended a hang) is started again,
up to R times, and resumes from the newest committed checkpoint. Each restart is a fresh
torchrun launch rather than torchrun's own `--max-restarts`: its in-agent restart reuses the
rendezvous store, and on torch 2.13 (CPU, gloo) the restarted group sometimes read the dead
ranks' stale addresses and failed or hung in connectFullMesh. HYPERLOOM_RESTART_COUNT tells
the workers which attempt they are. A group whose ranks failed with a user error (exit
status 2: they said why) is not restarted.

The launcher holds the run directory's lock across all attempts and waits, before a restart,
until every process of the failed attempt has exited (hyperloom.resilience.lock). torchrun's
agent runs as `python -m hyperloom.resilience.launch`: torchrun itself, except that a failed
group is described in one line (the first failed rank and how it ended) handed to the
launcher, instead of the agent's ChildFailedError traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from hyperloom.resilience.lock import AGENT_ENV, LOCK_ENV, RunDirLock, die_with_parent_hook
from hyperloom.resilience.watchdog import GAVE_UP_EXIT, gave_up_reason

if TYPE_CHECKING:  # torch is imported by the agent only, not by the launcher
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

log = logging.getLogger("hyperloom")

USER_ERROR_EXIT = 2  # a rank's status for a user error; the CLI's for one line of error
REPORT_ENV = "HYPERLOOM_AGENT_REPORT"  # the pipe the agent tells a failed group into


def launch(train_args: list[str], run_dir: str | os.PathLike, nproc: int, max_restarts: int) -> int:
    """Run `hyperloom train TRAIN_ARGS` under torchrun with `nproc` processes, restarting a
    failed group up to `max_restarts` times; the CLI's exit status."""
    cmd = [sys.executable, "-m", "hyperloom.resilience.launch", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", "hyperloom", "train", *train_args]
    with RunDirLock(run_dir).acquire() as lock:
        lock.share()  # the workers join it
        log.info("launching: torchrun %s", " ".join(cmd[3:]))
        for attempt in range(max_restarts + 1):
            if attempt:
                lock.wait_alone()  # no process of the failed attempt is left
            env = {**os.environ, "HYPERLOOM_RESTART_COUNT": str(attempt), LOCK_ENV: str(lock.path)}
            rc, what = _run_agent(cmd, env)
            reason = gave_up_reason(run_dir) if max_restarts else None
            if reason:  # the restart guard saw no progress: restarting would not help
                print(f"hyperloom train: gave up: {reason}", file=sys.stderr)
                return GAVE_UP_EXIT
            if rc == 0:
                return 0
            if rc == USER_ERROR_EXIT:  # the ranks said why; a restart would not help
                return USER_ERROR_EXIT
            what = what or f"torchrun exited with status {rc}"
            if attempt == max_restarts:
                after = f" after {attempt} restart(s)" if attempt else ""
                print(
                    f"hyperloom train: error: the process group failed{after}: {what}; the same "
                    f"command resumes from the newest checkpoint"
                    + ("" if max_restarts else " (--max-restarts R restarts it by itself)"),
                    file=sys.stderr,
                )
                return USER_ERROR_EXIT
            log.warning(
                "the process group failed: %s; restart %d of %d", what, attempt + 1, max_restarts
            )
    return USER_ERROR_EXIT


def _run_agent(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run the agent to its end: (exit status, its one line on a failed group or ""). The
    line comes through a pipe (REPORT_ENV names the agent's end), so nothing is left on
    disk whatever kills whom."""
    read, write = os.pipe()
    try:
        proc = subprocess.Popen(
            cmd,
            env={**env, REPORT_ENV: str(write)},
            pass_fds=(write,),
            preexec_fn=die_with_parent_hook(),
        )
        os.close(write)
        write = -1
        rc = proc.wait()
        chunks = []
        while chunk := os.read(read, 4096):  # EOF: the agent (the only writer) has exited
            chunks.append(chunk)
        return rc, b"".join(chunks).decode(errors="replace").strip()
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


def _first(item: tuple[int, ProcessFailure]) -> tuple[int, int, int]:
    """Order failures by time (whole seconds); in a tie a rank killed by a signal comes
    first, then one that exited with an error (its peer's death fails its collective), then
    one the agent stopped itself (SIGTERM)."""
    rank, failure = item
    code = failure.exitcode
    kind = 2 if code == -signal.SIGTERM else 0 if code < 0 else 1
    return failure.timestamp, kind, rank


def _quiet_elastic_logs() -> None:
    """The agent's own warnings and errors about a failed group ("Sending process N closing
    signal", "failed (exitcode ...)") repeat what the launcher's one line says."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _agent(argv: list[str]) -> int:
    """torchrun's agent (`torch.distributed.run`), a failed group told in one line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ[AGENT_ENV] = str(os.getpid())  # the workers' parent (stop_with_parent)
    if os.environ.get(REPORT_ENV):  # under our launcher, which tells a failure in one line
        _quiet_elastic_logs()
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = min(exc.failures.items(), key=_first)
        code = failure.exitcode
        how = f"was killed by {failure.signal_name()}" if code < 0 else f"exited with status {code}"
        what = f"rank {rank} (pid {failure.pid}) {how}"
        if os.environ.get(REPORT_ENV):
            os.write(int(os.environ[REPORT_ENV]), what.encode())
        else:
            print(f"torchrun: {what}", file=sys.stderr)
        return code if code > 0 else 1
    except SignalException as exc:  # the launcher died (PR_SET_PDEATHSIG), or a kill
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(_agent(sys.argv[1:]))
