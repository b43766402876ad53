"""Memory measurements the planner calibrates on, taken from our own training loop.

What a CPU training process keeps resident beyond its live tensors depends on how the
runtime allocates and frees during a step, so `plan calibrate` measures it with the trainer
itself: `RUNTIME_JOB` trained for a few steps in a fresh one-thread process (as a rank of a
multi-process job runs). The planner owns the model and the fit (`planner.host_memory`) and
never imports the trainer; the CLI and the trainer's self-check hand it
`measure_runtime_memory` (`planner.calibrate.calibrate(runtime_memory=...)`).
"""

from __future__ import annotations

import tempfile

from hyperloom.accelerator import Accelerator, peak_rss_bytes
from hyperloom.config import JobConfig, load_config
from hyperloom.planner.host_memory import LivePoller, in_fresh_process, live_heap_bytes
from hyperloom.train.trainer import Trainer

# A training job of our own runtime, smaller than the default model (the default tokenizer's
# vocabulary); the planner picks the micro-batch sizes it is trained at.
RUNTIME_JOB = ("--model.dim", "256", "--model.n_layers", "3", "--model.n_heads", "4",
               "--model.ffn_dim", "768", "--data.seq_len", "256")  # fmt: skip


def trainer_at_live_baseline(cfg: JobConfig) -> tuple[Trainer, int]:
    """(a `Trainer` for the job `cfg`, glibc's live bytes at the moment the trainer takes its
    pre-model memory baseline, the self-check's zero): live peaks above that number compare
    with the resident peak above `Trainer.memory_baseline`."""
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
    """`RUNTIME_JOB` at micro-batch `mbs` (in a fresh interpreter, `measure_runtime_memory`):
    the trainer's resident peak above its pre-model baseline, as the self-check measures it,
    and glibc's live peak through the last step above the live bytes at that baseline."""
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


def measure_runtime_memory(micro_batch: int, policy: str = "cache", steps: int = 3) -> dict:
    """One run of `RUNTIME_JOB` at `micro_batch` under the host allocator `policy`, in a fresh
    one-thread process: {micro_batch, resident_bytes, live_bytes, churn_bytes}, or {} where
    it cannot be measured (no glibc, or the run failed)."""
    return in_fresh_process(
        "hyperloom.train.probe._runtime_entry",
        [str(micro_batch), str(steps), policy],
        f"runtime memory at micro-batch {micro_batch}",
        env={"OMP_NUM_THREADS": "1"},
    )
