"""What a CPU process keeps resident beyond the bytes its tensors hold.

On a GPU the planner predicts allocated bytes, and the caching allocator's reserve is the
`ALLOC_FACTOR` in `memory.py`. A CPU job is measured as resident set size (the self-check's
peak RSS), and there two things sit above the live tensors:

- what a training process holds whatever the job's size: the compiled kernels' code and
  heap and the compiler's Python objects (pymalloc arenas, not malloc chunks). A fresh
  process kept 58 MB of heap after a small model's first compiled steps, and about 130 MB more
  of RSS;
- what glibc's malloc keeps of freed chunks: tensors below its (dynamic, up to 32 MiB) mmap
  threshold come from heaps, and the pages of freed chunks stay resident until the heap top
  can be trimmed. A training step frees and re-allocates its activations in a different
  order every pass, so holes accumulate.

The planner used to scale the live peak by one measured ratio (peak RSS / peak live of a
loop of plain linears, 1.35-1.54 between calibrations). Over the 12 validation layouts of
the default model the ratio was 1.25-1.76 while the difference, RSS minus live, stayed at
0.10-0.30 GB (docs/planner.md section 4): mostly a fixed amount, and more where a step
allocates and frees more. So `measure_runtime_memory` measures, with our own trainer on a
small job (`RUNTIME_JOB`, not the default model) at two micro-batch sizes, each in a fresh
one-thread process: peak RSS above the trainer's pre-model baseline, glibc's live bytes
(``mallinfo2``: in-use heap chunks plus mmapped chunks) polled through the last step, and
the live bytes between steps. The two jobs hold the same states and differ in what a step
churns (live peak less live between steps), so resident - live = fixed + churn x churned is
a line through them. Fitting resident = fixed + factor x live instead was ill-conditioned
(batches 2 and 8: 91 MB + 1.20 x; 2 and 16: 0 MB + 1.55-1.69 x). `hyperloom plan calibrate`
stores the two as ``host_runtime_bytes`` and ``host_churn_factor`` (about 100 MB and 0.35-0.45
on the development container); the memory model adds them to a rank's live peak with its
activations, working set and weight casts as the churn (`memory.rank_memory`). Built-in
GPU profiles keep 0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import subprocess
import sys

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


# A training job of our own runtime, smaller than the default model and two batch sizes apart:
# what `measure_runtime_memory` trains in fresh processes (the default tokenizer's vocabulary).
RUNTIME_JOB = ("--model.dim", "256", "--model.n_layers", "3", "--model.n_heads", "4",
               "--model.ffn_dim", "768", "--data.seq_len", "256")  # fmt: skip
RUNTIME_BATCHES = (2, 16)


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


def trainer_at_live_baseline(cfg):
    """(a `Trainer` for the job `cfg`, glibc's live bytes at the moment the trainer takes its
    pre-model memory baseline, the self-check's zero): live peaks above that number compare
    with the resident peak above `Trainer.memory_baseline`."""
    from hyperloom.accelerator import Accelerator
    from hyperloom.train.trainer import Trainer

    take, base = Accelerator.current_memory_bytes, {}

    def at_baseline(self) -> int:  # the trainer's baseline call: note the live heap there
        base.setdefault("live", live_heap_bytes() or 0)
        return take(self)

    Accelerator.current_memory_bytes = at_baseline
    try:
        trainer = Trainer(cfg)
    finally:
        Accelerator.current_memory_bytes = take
    return trainer, base["live"]


def _runtime_entry(mbs: str, steps: str, policy: str) -> dict[str, float]:
    """One training job of `RUNTIME_JOB` at micro-batch `mbs` (run in a fresh interpreter by
    `measure_runtime_memory`): the trainer's resident peak above its pre-model baseline, as
    the self-check measures it, and glibc's live peak through the last step above the live
    bytes at that baseline."""
    import tempfile

    from hyperloom.accelerator import peak_rss_bytes
    from hyperloom.config import load_config

    if live_heap_bytes() is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        args = [*RUNTIME_JOB, "--train.micro_batch_size", mbs, "--train.host_allocator", policy]
        args += ["--logging.run_dir", tmp, "--train.eval_batches", "1"]
        trainer, base = trainer_at_live_baseline(load_config(None, args))
        trainer.evaluate()  # as `Trainer.run` starts: evaluate, then reset the peak
        trainer.acc.reset_peak_memory()
        for _ in range(int(steps) - 1):
            trainer.train_step()
        between = (live_heap_bytes() or 0) - base  # the states, gradients freed
        with LivePoller() as poll:
            trainer.train_step()
        live = poll.peak - base
        return {
            "micro_batch": int(mbs),
            "resident_bytes": peak_rss_bytes() - trainer.memory_baseline,
            "live_bytes": live,
            "churn_bytes": live - between,
        }


def measure_runtime_memory(steps: int = 3, policy: str = "cache") -> dict[str, float]:
    """What a CPU training process keeps resident beyond its live tensors (module docstring):
    ``resident - live = fixed + churn * churned``, where ``churned`` is what a step allocates
    and frees (the live peak less the live bytes between steps: activations, the backward's
    working set, weight casts). Fitted through `RUNTIME_JOB` trained at the two
    `RUNTIME_BATCHES` in fresh processes (one thread each, as a rank of a multi-process job
    runs): the two batches hold the same states and differ in what they churn. {} where it
    cannot be measured (no glibc)."""
    runs = [
        in_fresh_process(
            "hyperloom.planner.host_memory._runtime_entry",
            [str(mbs), str(steps), policy],
            f"runtime memory at micro-batch {mbs}",
            env={"OMP_NUM_THREADS": "1"},
        )
        for mbs in RUNTIME_BATCHES
    ]
    if not all(runs):
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
    naming `what`) if it fails. A fresh process is what a training run starts from: its heap,
    its pages and, on this kind of VM, its luck with huge pages."""
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
