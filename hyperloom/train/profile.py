"""`logging.profile`: torch.profiler over chosen training steps, one Chrome trace per rank.

`logging.profile = "5-7"` (or `hyperloom train --profile 5-7`) records steps 5, 6 and 7 of
every rank with torch.profiler: CPU operators always, CUDA kernels on a CUDA device, input
shapes, and Python stacks with `logging.profile_stack`. Each step is wrapped in a
`ProfilerStep#N` range named after the training step, the name torch.profiler's own step
markers carry, so trace viewers and analysis tools split the trace into steps. The
profiler's one-time setup (Kineto, CUPTI on CUDA) runs after the step before the window
when there is one, outside the profiled steps: torch.profiler's "warmup" phase.

Written to RUN_DIR/profile/, named after the steps recorded, A to B, and the global rank R
(a run resumed inside the window adds files instead of replacing the first part's):

- `trace_stepsA-B_rankR.json`: the Chrome trace (https://ui.perfetto.dev, chrome://tracing);
- `ops_stepsA-B_rankR.txt`: the operators' `key_averages()` table, sorted by self time (the
  main rank also logs it);
- `memory_stepsA-B_rankR.pickle` (CUDA only): the caching allocator's history over the steps,
  `torch.cuda.memory._record_memory_history` / `_dump_snapshot`, for
  https://pytorch.org/memory_viz. https://pytorch.org/docs/stable/torch_cuda_memory.html

Every rank profiles the same steps (pipeline stages, dp and tp ranks alike), each its own
work. A run resumed inside the window profiles the window's remaining steps; a run that
stops inside it (`train.stop_at_step`, an error) writes what it recorded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from hyperloom.config.logging import LoggingConfig, profile_window
from hyperloom.train.report import run_dir_writes

log = logging.getLogger("hyperloom.train")

MEMORY_EVENTS = 100_000  # allocator events kept for the snapshot (PyTorch's docs' example)
TABLE_ROWS = 25


class StepProfiler:
    """Profiles the `logging.profile` window of this rank's steps; does nothing without one.

    The loop wraps each step in `step(n)` and calls `close()` when it ends, however it ends.
    """

    def __init__(
        self, lg: LoggingConfig, run_dir: Path, device_kind: str, rank: int, first_step: int
    ):
        self.rank = rank
        self.dir = Path(run_dir) / "profile"
        self.device_kind = device_kind
        self.cuda = device_kind == "cuda"
        self.stack = lg.profile_stack
        self.window = profile_window(lg.profile)
        self.prof: profile | None = None
        self.tracing = False
        self.last_step = 0  # the last step recorded (or begun)
        if self.window is None:
            return
        start, end = self.window
        if first_step >= end:
            log.info(
                "logging.profile: steps %d-%d ran before this run resumed at step %d; "
                "nothing profiled",
                start,
                end,
                first_step,
            )
            self.window = None
        elif first_step >= start:  # resumed inside the window: what is left of it
            log.info(
                "logging.profile: resumed at step %d, profiling steps %d-%d",
                first_step,
                first_step + 1,
                end,
            )
            self.window = (first_step + 1, end)

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Training step `n` (1-based): recorded inside the window, as `ProfilerStep#n`."""
        if self.window is None:  # none asked, or already written
            yield
            return
        start, end = self.window
        if n == start and not self.tracing:
            self._start()
        if not self.tracing:
            yield
        else:
            self.last_step = n
            with record_function(f"ProfilerStep#{n}"):
                yield
        if n == start - 1:  # warmup: the profiler's setup falls outside the first step
            self._prepare()
        elif n == end and self.tracing:
            self._finish()

    def close(self) -> None:
        """After the loop: a window it left early is written as far as it went; a failure
        here is a warning, so that it never hides the loop's own error."""
        if not self.tracing:
            if self.prof is not None and self.window is not None:  # set up, never started:
                self.prof.start_trace()  # let Kineto go, or the next profiler warns
                self.prof.stop_trace()
            return
        log.warning(
            "logging.profile: the run left steps %d-%d at step %d; the trace ends there",
            *self.window,
            self.last_step,
        )
        try:
            self._finish()
        except Exception as exc:  # noqa: BLE001 - the run's own error, if any, comes first
            log.warning("logging.profile: the trace was not written: %s", exc)

    # ---------------------------------------------------------------- torch.profiler

    def _prepare(self) -> None:
        if self.prof is None:
            activities = [ProfilerActivity.CPU]
            if self.cuda:
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities, record_shapes=True, with_stack=self.stack)
            self.prof.prepare_trace()  # Kineto's (and CUPTI's) setup

    def _start(self) -> None:
        self._prepare()
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
        self.prof.start_trace()
        self.tracing = True

    def _finish(self) -> None:
        """Stop recording; write the trace, the operator table and the memory snapshot."""
        start, end = self.window[0], self.last_step
        self.tracing, self.window = False, None  # once: a rollback does not profile again
        if self.cuda:
            torch.cuda.synchronize()  # the window's kernels belong in its trace
        self.prof.stop_trace()
        name = f"steps{start}-{end}_rank{self.rank}"
        trace = self.dir / f"trace_{name}.json"
        with run_dir_writes(self.dir):
            self.dir.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(trace))
            sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            table = self.prof.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS)
            (self.dir / f"ops_{name}.txt").write_text(table + "\n")
            snapshot = self._memory_snapshot(self.dir / f"memory_{name}.pickle")
        log.info("profile of steps %d-%d, rank %d, by %s:\n%s", start, end, self.rank, sort, table)
        log.info(
            "profile: %s (Perfetto or chrome://tracing)%s",
            trace,
            f"; memory snapshot {snapshot} (pytorch.org/memory_viz)" if snapshot else "",
        )

    def _memory_snapshot(self, path: Path) -> Path | None:
        if not self.cuda:
            log.info("logging.profile: no memory snapshot on %s (CUDA only)", self.device_kind)
            return None
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        return path
