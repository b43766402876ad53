"""Metric sinks: TensorBoard and Weights & Biases beside metrics.jsonl (`logging.sinks`).

Every record the `Reporter` writes to metrics.jsonl (train lines, validation losses,
resilience events) also goes, on the main rank, to each sink that `logging.sinks` names,
as scalars tagged `EVENT/KEY` (`train/loss`, `train/mfu`, `eval/val_loss`, nested values as
`train/expert_load/LAYER`) at the record's step. The sinks only mirror metrics.jsonl: the
trainer never reads them back, and a run without them loses nothing.

- TensorBoard: `torch.utils.tensorboard.SummaryWriter` event files in RUN_DIR/tensorboard,
  flushed per record as metrics.jsonl is, so a crashed run keeps what it logged. A resumed
  run opens the writer with `purge_step` = the first step it trains, and TensorBoard drops
  what an earlier run logged from that step on (records after the checkpoint that a crash lost)
  instead of drawing those steps twice; a fresh run purges the old run's steps entirely.
  https://pytorch.org/docs/stable/tensorboard.html
- W&B: `wandb.init(dir=RUN_DIR, mode=logging.wandb_mode)`, offline by default (a run folder
  under RUN_DIR/wandb to `wandb sync` later), with the job config as the run's config. The
  x-axis is our `step` (`define_metric`), not W&B's own counter, so a rollback's repeated
  steps are logged rather than dropped; a resumed run continues the same W&B run id.
  https://docs.wandb.ai/ref/python/init/

`TrackedReporter` is the Reporter with the sinks attached, closed with it, also on error.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Protocol

from hyperloom.config import ConfigError, JobConfig, LoggingConfig, to_dict
from hyperloom.train.report import Reporter, run_dir_writes

log = logging.getLogger("hyperloom.train")

# Record fields that are not metrics: the x-axis, the record's kind, a wall-clock stamp.
NOT_SCALARS = ("step", "event", "time")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # what each optional sink needs
TRACK_EXTRA = "pip install 'hyperloom[track]'"


def check_sinks(lg: LoggingConfig) -> None:
    """A sink asked for whose package is not installed: one ConfigError naming the extra,
    raised before anything is built (W&B switched off needs none)."""
    for sink in lg.sinks:
        if sink == "wandb" and lg.wandb_mode == "disabled":
            continue
        package = PACKAGES.get(sink)
        if package is not None and find_spec(package) is None:
            raise ConfigError(
                f"logging.sinks has '{sink}' but the {package} package is not installed; "
                f"{TRACK_EXTRA}"
            )


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers as `EVENT/KEY` tags (bools, text and None left out)."""
    prefix = record.get("event", "metrics")

    def flat(key: str, value: Any) -> Iterator[tuple[str, float]]:
        if isinstance(value, dict):
            for k, v in value.items():
                yield from flat(f"{key}/{k}", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, float(value)

    out: dict[str, float] = {}
    for key, value in record.items():
        if key not in NOT_SCALARS:
            out.update(flat(f"{prefix}/{key}", value))
    return out


class Sink(Protocol):
    """Somewhere a run's scalars go."""

    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _import(sink: str, module: str) -> Any:
    """The sink's package; one configuration line naming the extra if it will not import."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"logging.sinks has '{sink}' but {module} fails to import ({exc}); {TRACK_EXTRA}"
        ) from None


class TensorBoardSink:
    """Scalars in TensorBoard event files under RUN_DIR/tensorboard."""

    def __init__(self, run_dir: Path, purge_step: int):
        tensorboard = _import("tensorboard", "torch.utils.tensorboard")
        self.dir = run_dir / "tensorboard"
        with run_dir_writes(self.dir):
            self.writer = tensorboard.SummaryWriter(str(self.dir), purge_step=purge_step)

    def write(self, step: int, values: dict[str, float]) -> None:
        with run_dir_writes(self.dir):
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in RUN_DIR/wandb; its id is kept there, so that a resumed run continues it."""

    def __init__(self, cfg: JobConfig, run_dir: Path, resumed: bool):
        wandb = _import("wandb", "wandb")
        lg = cfg.logging
        id_file = run_dir / "wandb" / "hyperloom-run-id"
        with run_dir_writes(id_file):
            run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
        try:
            self.run = wandb.init(
                project=lg.wandb_project,
                name=lg.wandb_name or run_dir.resolve().name,
                id=run_id,  # None: a new run, its id made by W&B
                resume="allow" if run_id else None,
                dir=str(run_dir),
                mode=lg.wandb_mode,
                config=to_dict(cfg),
                # our log lines and progress bar go to the terminal, not into the W&B run
                settings=wandb.Settings(console="off"),
            )
        except Exception as exc:  # noqa: BLE001 - wandb raises its own kinds (no login, ...)
            raise ConfigError(
                f"logging.sinks has 'wandb' but wandb.init failed in {lg.wandb_mode} mode: {exc}"
            ) from None
        with run_dir_writes(id_file):
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(self.run.id + "\n")
        self.run.define_metric("*", step_metric="step")
        log.info("W&B run %s (%s) in %s", self.run.id, lg.wandb_mode, run_dir / "wandb")

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def close(self) -> None:
        self.run.finish()


def open_sinks(cfg: JobConfig, run_dir: Path, first_step: int, resumed: bool) -> list[Sink]:
    """The sinks `logging.sinks` names (jsonl is the Reporter's own file); if one fails to
    open, those opened before it are closed again."""
    lg = cfg.logging
    sinks: list[Sink] = []
    try:
        if "tensorboard" in lg.sinks:
            # resumed: TensorBoard drops the earlier run's events from the first new step on
            sinks.append(TensorBoardSink(run_dir, first_step + 1 if resumed else 0))
        if "wandb" in lg.sinks and lg.wandb_mode != "disabled":
            sinks.append(WandbSink(cfg, run_dir, resumed))
    except BaseException:
        close_all(sinks)
        raise
    return sinks


def close_all(sinks: list[Sink]) -> None:
    """Close every sink, even when one of them fails (the first failure is raised after)."""
    error: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:  # noqa: BLE001 - the others must still close
            error = error or exc
    if error is not None:
        raise error


class TrackedReporter(Reporter):
    """The Reporter, and every record it writes also sent to `logging.sinks` (main rank)."""

    def __init__(
        self,
        cfg: JobConfig,
        first_step: int,
        total_steps: int,
        *,
        progress: bool = True,
        append: bool = False,
        enabled: bool = True,
    ):
        run_dir = Path(cfg.logging.run_dir)
        super().__init__(run_dir, total_steps, progress=progress, append=append, enabled=enabled)
        self.sinks: list[Sink] = []
        if not enabled:
            return
        try:
            self.sinks = open_sinks(cfg, run_dir, first_step, resumed=append)
        except BaseException:
            super().close()
            raise

    def _write(self, record: dict[str, Any]) -> None:
        super()._write(record)
        step = record.get("step")
        if self.sinks and isinstance(step, int):  # a record without a step has no x
            values = scalars(record)
            for sink in self.sinks:
                sink.write(step, values)

    def close(self) -> None:
        try:
            super().close()
        finally:
            sinks, self.sinks = self.sinks, []
            close_all(sinks)
