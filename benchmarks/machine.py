"""What the benchmarks need to know about the machine: its description, peak memory, and
how much of the CPU other processes took while we measured.

On a shared CPU machine the main source of noise is other work: when another process takes
one of two cores, a 2-thread PyTorch step slows several-fold (the OpenMP threads wait at every
barrier for the descheduled one). Reading /proc/stat around each step tells how many cores
others used meanwhile, so disturbed steps can be counted instead of averaged in silently.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hyperloom.accelerator import (  # noqa: F401 - the benchmarks call machine.peak_rss_bytes
    get_accelerator,
    peak_rss_bytes,
    reset_peak_rss,
)

BUSY_CORES = 0.2  # a step is contended if other processes averaged more than this many cores
QUIET_WAIT_S = 60  # before each run, wait up to this long for other processes to settle


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU-seconds of the whole machine, of this process) so far; None off Linux.

    The difference is what other processes (and the hypervisor, as steal time) took while we
    ran: on a shared machine that is the main source of noise, so every step records it.
    """
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields)
    machine = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = resource.getrusage(resource.RUSAGE_SELF)
    return machine, own.ru_utime + own.ru_stime


def wait_for_quiet(timeout_s: float = QUIET_WAIT_S) -> float:
    """Wait until other processes leave the CPUs alone for 2 s in a row; returns seconds waited.

    Gives up after `timeout_s` (the run then goes ahead and reports its own contention).
    """
    start, quiet = time.perf_counter(), 0
    while quiet < 2 and time.perf_counter() - start < timeout_s:
        c0, t0 = cpu_seconds(), time.perf_counter()
        if c0 is None:
            return 0.0
        time.sleep(1.0)
        c1 = cpu_seconds()
        other = ((c1[0] - c0[0]) - (c1[1] - c0[1])) / (time.perf_counter() - t0)
        quiet = quiet + 1 if other < BUSY_CORES else 0
    return time.perf_counter() - start


def hyperloom_revision() -> dict[str, Any]:
    """The commit hyperloom was measured at, and whether its package tree had local edits."""
    import subprocess

    import hyperloom

    root = Path(hyperloom.__file__).resolve().parent
    try:

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()

        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", ".")),
        }
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def machine_info(threads: int, device: str) -> dict[str, Any]:
    """Versions, device, CPU model and flags, and the hyperloom revision, for the JSON."""
    import importlib.metadata as md

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": threads,
        "logical_cpus": os.cpu_count(),
        "device": get_accelerator(device).describe(),
        "hyperloom_revision": hyperloom_revision(),
    }
    for pkg in ("transformers", "hyperloom"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
        flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
        info["cpu_model"] = model.group(1).strip() if model else None
        wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
        info["cpu_flags"] = [f for f in wanted if flags and f in flags.group(1).split()]
    except OSError:
        info["cpu_model"] = None
    return info


def write_results(path: str | Path, payload: dict[str, Any]) -> None:
    """Write a benchmark's JSON with this machine's paths taken out: the repository root
    becomes repository-relative and the temporary directory `$TMPDIR`, so results describe the
    project, not where it ran (the interpreter is called `python`)."""
    root = str(Path(__file__).resolve().parent.parent) + "/"
    tmp = tempfile.gettempdir().rstrip("/")
    text = json.dumps(payload, indent=2, default=str) + "\n"
    text = text.replace(sys.executable, "python").replace(root, "")
    Path(path).write_text(text.replace(tmp + "/", "$TMPDIR/"))


def timed_train(
    config: Path, run_dir: Path, args: list[str], cache: Path | None = None
) -> tuple[float, dict[str, Any], str, float | None]:
    """`python -m hyperloom train CONFIG --run-dir RUN_DIR ARGS` as a user runs it, timed from
    start to exit; `cache` a fresh data/planner cache (a first run on a new machine). Returns
    (wall s, summary.json, stderr, the machine's busy cores during the run, ours included);
    SystemExit with the stderr tail if it fails."""
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "HYPERLOOM_CACHE": str(cache)} if cache else None
    cmd = [sys.executable, "-m", "hyperloom", "train", str(config), "--run-dir", str(run_dir),
           "--logging.progress", "false", *args]  # fmt: skip
    before = cpu_seconds()
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    after = cpu_seconds()
    busy = (after[0] - before[0]) / wall if before and after else None
    summary = json.loads((run_dir / "summary.json").read_text())
    return wall, summary, result.stdout + result.stderr, busy


def train_runs_parser(doc: str, default_seed: str) -> Any:
    """The arguments of a benchmark that times `hyperloom train` once per seed (`timed_train`):
    --seeds, --json, and extra `--section.key value` overrides; the caller adds its own."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--seeds", default=default_seed, help="comma-separated train.seed values")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("extra", nargs="*", help="more --section.key value overrides")
    return ap
