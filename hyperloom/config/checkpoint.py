"""The `[checkpoint]` section: saving and resuming (hyperloom.checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob, positive

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming."""

    every: int = knob(0, "steps between checkpoints (0 = only at the end)")
    keep: int = knob(2, "how many of the newest checkpoints to keep")
    resume: str = knob(
        "auto", "auto = newest checkpoint in the run dir; none; or a checkpoint path"
    )
    init_from: str = knob(
        "",
        "a fresh run starts from these weights (checkpoint or run dir; no optimizer state, "
        "step 0): the names it shares with this model, e.g. a llama run for a vlm's decoder; "
        "hf:DIR (or a dir with config.json + safetensors) converts a Hugging Face model, "
        "whose tokenizer.json becomes the default data.tokenizer",
    )
    async_save: bool = knob(
        False, "stage a CPU copy and write it in a background thread while training goes on"
    )
    format: str = knob(
        "whole",
        "whole = gathered tensors, one safetensors file by the main rank; sharded = every rank "
        "writes its own shards (torch.distributed.checkpoint), resharded on load",
        choices=["whole", "sharded"],
    )

    def problems(self, job: JobConfig) -> list[str]:
        p = []
        if not self.resume.strip():
            p.append("checkpoint.resume is empty; use auto, none or a checkpoint path")
        if self.init_from.startswith("hf:") and not self.init_from[3:].strip():
            p.append("checkpoint.init_from = 'hf:' names no directory; use hf:DIR")
        if self.every < 0:
            p.append(f"checkpoint.every must be >= 0 (0 = only at the end), got {self.every}")
        return p + positive("checkpoint.keep", self.keep)
