"""The replay of a recomputed forward: what stateful layers do when activation checkpointing
runs their forward a second time, inside the backward.

A recomputed forward must produce the tensors of the first one and change nothing else. Two
kinds of state would otherwise move: delayed FP8 scaling (each quantization updates the
scale from the amax history, then records the new amax) and an MoE router's expert loads
(counted for the balancing bias). TransformerEngine keeps the forward's FP8 scales for its
recompute phase the same way; here a `Replay` log holds, in call order, every scale the
first pass used, and the second pass takes them back from it without touching any history.
Layers ask `replaying()` to leave their counters alone.

One `Replay` serves one checkpointed region of one micro-batch: the first `run` records,
every later `run` replays from the start (a recompute may stop early once it has what the
backward needs, so each replay starts afresh).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_active = threading.local()  # the Replay of the region running on this thread, if any


class Replay:
    """The values one checkpointed region's first forward used, for its recomputes."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []
        self.passes = 0
        self.position = 0

    @contextmanager
    def run(self) -> Iterator[None]:
        """One pass of the region: recording on the first, replaying on the others."""
        outer = getattr(_active, "replay", None)
        self.passes += 1
        self.position = 0
        _active.replay = self
        try:
            yield
        finally:
            _active.replay = outer

    @property
    def replaying(self) -> bool:
        return self.passes > 1

    def scale(self, compute) -> torch.Tensor:
        """The scale for this quantization: `compute()` (which updates the state) on the
        first pass, recorded; the recorded one, untouched state, on a replay."""
        if not self.replaying:
            value = compute()
            self.values.append(value.detach().clone())
            return value
        if self.position >= len(self.values):
            raise RuntimeError(
                "a recomputed forward quantized more tensors than the first pass "
                f"({len(self.values)}): the region does not run the same way twice"
            )
        value = self.values[self.position]
        self.position += 1
        return value


def current() -> Replay | None:
    """The region being run on this thread, or None outside checkpointed regions."""
    return getattr(_active, "replay", None)


def replaying() -> bool:
    """Whether this is a recomputation: stateful layers must leave their state alone."""
    replay = current()
    return replay is not None and replay.replaying
