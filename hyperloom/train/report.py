"""What a run shows and leaves behind: progress bar, log lines, metrics.jsonl, plot, summary.

The trainer calls a `Reporter`; nothing in the loop formats text. Files written to RUN_DIR:

- `metrics.jsonl`: one JSON object per line, `"event": "train"` every log interval (step,
  loss, lr, grad_norm, tokens_per_s, mfu, memory_gb, elapsed_s) and `"event": "eval"` per
  validation (step, val_loss, and val_bpb: bits per byte of the held-out text);
- `summary.json`: the final numbers of the run;
- `loss_curve.png`: training and validation loss against step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from hyperloom.data.progress import logging_console
from hyperloom.resilience.events import read_jsonl, repair_tail
from hyperloom.resilience.lock import RunDirError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("hyperloom.train")


def bits_per_byte(loss_nats: float, bytes_per_token: float) -> float:
    """Cross-entropy per token (nats) as bits per byte of text: comparable across tokenizers
    (a larger vocabulary lowers the loss per token only by covering more bytes per token)."""
    return loss_nats / math.log(2) / bytes_per_token


def text_bytes_per_token(tokenizer: Any, labels: Iterable[torch.Tensor]) -> float | None:
    """UTF-8 bytes per scored token of validation label batches: each row decoded whole
    (ignored labels, < 0, dropped; special tokens such as eos decode to no bytes and still
    count as tokens, the usual convention). None when nothing is scored or decodes to text."""
    tokens = nbytes = 0
    for batch in labels:
        for row in batch.reshape(-1, batch.shape[-1]).tolist():
            ids = [i for i in row if i >= 0]
            tokens += len(ids)
            nbytes += len(tokenizer.decode(ids).encode("utf-8"))
    return nbytes / tokens if tokens and nbytes else None


@contextlib.contextmanager
def run_dir_writes(path: Path) -> Iterator[None]:
    """An OSError while writing `path` in the run directory (a full or read-only volume)
    becomes a RunDirError that names the file: one line and exit status 2, no traceback."""
    try:
        yield
    except OSError as exc:
        raise RunDirError(f"cannot write {path}: {exc.strerror or exc}") from None


class Reporter:
    """Writes the run's files and draws its progress; a disabled reporter (every rank but the
    main one) does nothing, so the loop calls it unconditionally."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        total_steps: int,
        progress: bool = True,
        console: Console | None = None,
        append: bool = False,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.history: list[dict[str, Any]] = []
        self._warned_mfu = False
        self._progress = None
        if not enabled:
            return
        self.metrics_path = self.run_dir / "metrics.jsonl"
        with run_dir_writes(self.metrics_path):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if append:  # after a crash: a torn last line is cut, the records before it kept
                repair_tail(self.metrics_path)
                self.history = read_jsonl(self.metrics_path)
            self._metrics = self.metrics_path.open("a" if append else "w")
        # the log lines' console: the bar and the lines share one screen region
        self.console = console or logging_console()
        if progress:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task("train", total=total_steps, loss="-")

    def start(self, first_step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=first_step)
            self._progress.start()

    def step(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def _write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.history.append(record)
        with run_dir_writes(self.metrics_path):
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()

    def train_metrics(self, record: dict[str, Any], total_steps: int, peak_tflops: float) -> None:
        if not self.enabled:
            return
        self._write({"event": "train", **record})
        if record["mfu"] > 1.0 and not self._warned_mfu:
            self._warned_mfu = True
            log.warning(
                "MFU above 100%%: the measured peak (%.3g TFLOP/s) was too low, probably "
                "because the machine was busy; set logging.peak_tflops",
                peak_tflops,
            )
        if self._progress is not None:
            self._progress.update(self._task, loss=f"{record['loss']:.3f}")
        log.info(
            "step %d/%d | loss %.4f | lr %.2e | grad %.2f | %s tok/s | MFU %.1f%% | mem %.2f GB",
            record["step"],
            total_steps,
            record["loss"],
            record["lr"],
            record["grad_norm"],
            f"{record['tokens_per_s']:,.0f}",
            100 * record["mfu"],
            record["memory_gb"],
        )

    def eval_metrics(
        self, step: int, val_loss: float, bytes_per_token: float | None = None
    ) -> None:
        """A validation; with the held-out batches' bytes per token, also in bits per byte."""
        if not self.enabled:
            return
        record: dict[str, Any] = {"event": "eval", "step": step, "val_loss": val_loss}
        if bytes_per_token:
            record["val_bpb"] = bits_per_byte(val_loss, bytes_per_token)
            log.info(
                "step %d | validation loss %.4f | %.3f bits per byte",
                step,
                val_loss,
                record["val_bpb"],
            )
        else:
            log.info("step %d | validation loss %.4f", step, val_loss)
        self._write(record)

    def event(self, record: dict[str, Any]) -> None:
        """Any other record (resilience events: anomaly, rollback, ...), written at once."""
        self._write(record)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self.enabled and not self._metrics.closed:
            with run_dir_writes(self.metrics_path):
                self._metrics.close()

    def plot(self) -> Path | None:
        """Loss curve PNG from the metrics history."""
        train = [(r["step"], r["loss"]) for r in self.history if r.get("event") == "train"]
        evals = [(r["step"], r["val_loss"]) for r in self.history if r.get("event") == "eval"]
        if not train and not evals:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        if train:
            ax.plot(*zip(*train, strict=True), label="train loss", color="tab:blue")
        if evals:
            ax.plot(*zip(*evals, strict=True), "o-", label="validation loss", color="tab:orange")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        scale = [r["val_bpb"] / r["val_loss"] for r in self.history if r.get("val_bpb")]
        if scale:  # the same curves read in bits per byte on the right
            k = scale[-1]
            right = ax.secondary_yaxis("right", functions=(lambda x: x * k, lambda y: y / k))
            right.set_ylabel("bits per byte (validation text)")
        ax.set_title(f"hyperloom: {self.run_dir.name}")
        ax.grid(alpha=0.3)
        ax.legend()
        out = self.run_dir / "loss_curve.png"
        fig.tight_layout()
        try:
            with run_dir_writes(out):
                fig.savefig(out, dpi=110)
        finally:
            plt.close(fig)
        return out


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> Path:
    """RUN_DIR/summary.json, replaced whole (a kill mid-write leaves the old one)."""
    path = Path(run_dir) / "summary.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with run_dir_writes(path):
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return path


# summary.json keys the table leaves out (the JSON keeps them): the planner's internals,
# and the per-rank list when it repeats the one figure
_TABLE_HIDDEN = frozenset(
    {
        "sample",
        "peak_memory_measures",
        "peak_memory_gb_per_rank",
        "predicted_step_s",
        "measured_step_s",
        "step_time_error",
        "predicted_peak_memory_gb",
        "measured_peak_memory_gb",
        "memory_error",
        "predicted_live_memory_gb",
        "predicted_memory_rank",
    }
)
_TABLE_LABELS = {
    "initial_val_bpb": "initial val bits per byte",
    "final_val_bpb": "final val bits per byte",
    "tokens_per_s": "tokens per s",
    "mfu": "MFU",
}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _versus(predicted: float, measured: float, unit: str) -> str:
    """'predicted X / measured Y unit (+e%)', the planner beside the run."""
    return f"{predicted:.3g} / {measured:.3g} {unit} ({predicted / measured - 1:+.0%})"


def summary_table(summary: dict[str, Any]) -> Table:
    """The end-of-run table printed on the terminal: one measured peak-memory figure, named
    for what it measures, and the planner's predictions as predicted / measured pairs."""
    table = Table(title="hyperloom run summary", show_header=False, title_style="bold")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    per_rank = summary.get("peak_memory_gb_per_rank")
    for key, value in summary.items():
        if key in _TABLE_HIDDEN or key.startswith("plan_") or value is None:
            continue
        if isinstance(value, dict):
            continue
        if key == "peak_memory_gb":
            what = summary.get("peak_memory_measures", "")
            label = f"peak memory, {what}, GB" if what else "peak memory, GB"
            if per_rank and len(per_rank) > 1:
                label, value = f"peak memory of the largest rank, {what}, GB", max(per_rank)
            table.add_row(label, _fmt(value))
        else:
            table.add_row(_TABLE_LABELS.get(key, key.replace("_", " ")), _fmt(value))
    step_p, step_m = summary.get("predicted_step_s"), summary.get("measured_step_s")
    if step_p and step_m:
        table.add_row("planner step time, predicted / measured", _versus(step_p, step_m, "s"))
    mem_p, mem_m = summary.get("predicted_peak_memory_gb"), summary.get("measured_peak_memory_gb")
    if mem_p and mem_m:
        table.add_row(
            "planner memory above the start, predicted / measured",
            _versus(mem_p, mem_m, "GB"),
        )
    return table
