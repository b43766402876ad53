"""What a CPU process keeps resident beyond the bytes its tensors hold, and how it is fitted.

On a CPU a job is measured as resident set size, and above the live tensors sit a fixed part
(compiled kernels, the compiler's Python objects) and the pages glibc's malloc keeps of freed
chunks. So resident - live = fixed + churn x churned, churned being what a step allocates and
frees. `fit_runtime_memory` draws that line through two training runs at `RUNTIME_BATCHES`
handed over by the trainer (`train.probe`); `plan calibrate` stores it as
``host_runtime_bytes`` and ``host_churn_factor``. Also here: glibc's live bytes
(``mallinfo2``), a polling thread, and a fresh interpreter to measure in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable

log = logging.getLogger("hyperloom.planner")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2():
    """glibc's `mallinfo2`, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def live_heap_bytes() -> int | None:
    """Bytes glibc's malloc has handed out and not taken back (heap chunks in use plus mmapped
    chunks), or None without glibc."""
    info = _mallinfo2()
    if info is None:
        return None
    m = info()
    return m.uordblks + m.hblkhd


class LivePoller:
    """glibc's live bytes polled from a thread while a block runs; `peak` their maximum. Not
    a dispatch mode: under one, torch.compile runs the compiled kernels' Python bodies instead,
    whose float32 temporaries would count."""

    def __init__(self, every_s: float = 1e-4):
        self.every_s, self.peak = every_s, 0

    def __enter__(self):
        import threading

        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, live_heap_bytes() or 0)
            self.stop.wait(self.every_s)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


# Micro-batch sizes of the two training runs the fit goes through.
RUNTIME_BATCHES = (2, 16)

# One training run at a micro-batch size under a host allocator policy -> its
# {resident_bytes, live_bytes, churn_bytes}, {} if not measured: the trainer's
# `train.probe.measure_runtime_memory`, handed to `calibrate` by its caller.
RuntimeMemoryProbe = Callable[[int, str], dict]


def fit_runtime_memory(runs: list[dict]) -> dict:
    """``resident - live = fixed + churn * churned`` through two training runs (module
    docstring), each {resident_bytes, live_bytes, churn_bytes} at one of `RUNTIME_BATCHES`:
    {"runs", "churn_factor", "fixed_bytes"}, or {} when a run is missing (no glibc)."""
    if len(runs) != 2 or not all(runs):
        return {}
    (s1, a1), (s2, a2) = ((r["resident_bytes"] - r["live_bytes"], r["churn_bytes"]) for r in runs)
    churn = max(0.0, (s2 - s1) / (a2 - a1)) if a2 > a1 else 0.0
    fixed = max(0.0, s1 - churn * a1)
    return {"runs": runs, "churn_factor": churn, "fixed_bytes": fixed}


_LAUNCHER_VARS = (
    "TORCHELASTIC_",
    "MASTER_",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_",
    "TORCH_",
    "HYPERLOOM_RESTART",
)


def standalone_env() -> dict[str, str]:
    """This process's environment without a launcher's variables: a child started from a
    torchrun worker (the training self-check calibrates there) would otherwise join
    torchrun's rendezvous store, or initialise a process group, and hang."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARS)}


def in_fresh_process(call: str, args: list[str], what: str, env: dict | None = None) -> dict:
    """`print(json.dumps(call(*argv)))` in a fresh interpreter -> that dict; {} (and a warning
    naming `what`) if it fails. A fresh process is what a training run starts from: its own
    heap and pages."""
    module, _, name = call.rpartition(".")
    code = (
        f"import json, sys; from {module} import {name}; print(json.dumps({name}(*sys.argv[1:])))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            env={**standalone_env(), **(env or {})},
            timeout=300,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.warning("%s not measured: %s", what, exc)
        return {}
