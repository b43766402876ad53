"""The `[logging]` section: what a run reports and where."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob, positive

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig


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
        return p
