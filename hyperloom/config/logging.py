"""The `[logging]` section: what a run reports and where.

Besides metrics.jsonl (always written) a run can send its metric records to TensorBoard and
Weights & Biases (`sinks`), and profile chosen steps with torch.profiler (`profile`); both
are described in docs/tracking.md. Whether a sink's package is installed is checked where
the sinks live (hyperloom.train.sinks), when a run starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob, positive

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig

SINKS = ("jsonl", "tensorboard", "wandb")  # where metric records can go


def profile_window(text: str) -> tuple[int, int] | None:
    """`logging.profile` as (first, last) training step, both inclusive; None when off.

    'START-END' or 'STEP'; ValueError for anything else (the validator words it)."""
    text = text.strip()
    if not text:
        return None
    first, sep, last = text.partition("-")
    try:
        start, end = int(first), int(last if sep else first)
    except ValueError:
        raise ValueError("is not a step range") from None
    if start > end:
        raise ValueError(f"starts after it ends, at {start} > {end}")
    return start, end


@dataclass(frozen=True)
class LoggingConfig:
    """What a run reports and where."""

    run_dir: str = knob("runs/default", "directory for metrics, plots, checkpoints")
    log_every: int = knob(10, "steps between metric lines")
    peak_tflops: float = knob(
        0.0,
        "peak TFLOP/s for MFU; 0 = measure this machine's matmul peak (BF16, or the "
        "training dtype where that is faster)",
    )
    progress: bool = knob(True, "show a progress bar")
    plot: bool = knob(True, "write loss_curve.png")
    sample_prompt: str = knob("def ", "prompt for the sample printed after training ('' = none)")
    sample_tokens: int = knob(96, "tokens to generate for that sample")
    eval_answers: int = knob(
        200,
        "vlm: held-out questions answered by greedy decoding after training, for the "
        "accuracy, a caption and vlm_eval.png (0 = none)",
    )
    self_check: str = knob(
        "auto",
        "planner's predicted step time and memory beside the measured ones: auto (a profile "
        "of this machine, measured once and cached), off, or a `plan calibrate` JSON",
    )
    sinks: list[str] = knob(
        doc="where metric records go: jsonl (metrics.jsonl, always written), tensorboard "
        "(RUN_DIR/tensorboard), wandb (RUN_DIR/wandb); the last two need the track extra",
        factory=lambda: ["jsonl"],
    )
    wandb_mode: str = knob(
        "offline",
        "W&B: offline (a local run to `wandb sync` later), online, or disabled",
        choices=["offline", "online", "disabled"],
    )
    wandb_project: str = knob("hyperloom", "W&B project")
    wandb_name: str = knob("", "W&B run name ('' = the run directory's name)")
    profile: str = knob(
        "",
        "training steps to profile with torch.profiler, 'START-END' or 'STEP' (inclusive; "
        "'' = none): a Chrome trace per rank, and a CUDA memory snapshot, in RUN_DIR/profile",
    )
    profile_stack: bool = knob(False, "profiled steps record Python stacks (slower, larger)")

    def problems(self, job: JobConfig) -> list[str]:
        p = positive("logging.log_every", self.log_every)
        if not self.run_dir.strip():
            p.append("logging.run_dir is empty; name the directory for this run")
        if not self.self_check.strip():
            p.append("logging.self_check is empty; use auto, off or a `plan calibrate` JSON")
        if self.peak_tflops < 0:
            p.append(f"logging.peak_tflops must be >= 0 (0 = measure), got {self.peak_tflops}")
        if self.eval_answers < 0:
            p.append(f"logging.eval_answers must be >= 0 (0 = none), got {self.eval_answers}")
        if self.sample_tokens < 0:
            p.append(f"logging.sample_tokens must be >= 0, got {self.sample_tokens}")
        return p + self._sink_problems() + self._profile_problems(job.train.steps)

    def _sink_problems(self) -> list[str]:
        p = [
            f"logging.sinks: unknown sink '{sink}'; choose from {', '.join(SINKS)}"
            for sink in self.sinks
            if sink not in SINKS
        ]
        if "wandb" in self.sinks and not self.wandb_project.strip():
            p.append("logging.wandb_project is empty; name the W&B project")
        return p

    def _profile_problems(self, steps: int) -> list[str]:
        allowed = f"use 'START-END' or 'STEP' within 1-{steps} (train.steps), or '' for none"
        try:
            window = profile_window(self.profile)
        except ValueError as exc:
            return [f"logging.profile = {self.profile!r} {exc}; {allowed}"]
        if window is not None and not 1 <= window[0] <= window[1] <= steps:
            return [f"logging.profile = {self.profile!r} lies outside the run's steps; {allowed}"]
        return []
