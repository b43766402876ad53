"""Tests for experiment tracking and profiling: `logging.sinks` and `logging.profile`.

Every run is the tiny fp32 job of conftest.tiny_job for a handful of steps. The sinks are read
back with their own readers (TensorBoard's EventAccumulator; W&B's offline transaction log,
which is LevelDB's log format of `wandb.proto` Records) and compared with metrics.jsonl; the
profiler's Chrome trace is parsed and its step markers and operators checked.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from hyperloom.config import ConfigError, load_config
from hyperloom.train import sinks as sinks_module
from hyperloom.train.sinks import scalars
from hyperloom.train.trainer import Trainer

TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_gb", "elapsed_s")


def job(run_dir: Path, tiny_job_args, **overrides):
    return load_config(None, tiny_job_args(run_dir, **overrides))


def records(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.fixture(autouse=True)
def wandb_home(tmp_path, monkeypatch):
    """W&B's cache and settings (its service's logs) in the test's folder, not ~."""
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)


# --------------------------------------------------------------------------- readers


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in RUN_DIR/tensorboard as (step, value) pairs, after purges."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path: Path) -> list:
    """The Records of a W&B transaction log: a 7-byte header, then LevelDB log blocks of
    32 KiB whose chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) hold them."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, held, out = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        held = chunk if kind in (1, 2) else held + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(held)
            out.append(record)
    return out


# --------------------------------------------------------------------------- sinks


def test_scalars_flatten_numbers_and_leave_out_the_rest():
    record = {
        "event": "train",
        "step": 3,
        "loss": 2.5,
        "tokens": 7,
        "healthy": True,
        "note": "x",
        "mfu": None,
        "expert_load": {"layers.1": 1.5},
        "time": 1.7e9,
    }
    assert scalars(record) == {
        "train/loss": 2.5,
        "train/tokens": 7.0,
        "train/expert_load/layers.1": 1.5,
    }


def test_tensorboard_scalars_equal_metrics_jsonl(tiny_job_args, tmp_path):
    run = tmp_path / "tb"
    cfg = job(
        run, tiny_job_args, train__steps=6, train__eval_every=3, logging__sinks="jsonl,tensorboard"
    )
    Trainer(cfg).run()
    tb = tensorboard_scalars(run)
    train = records(run, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for key in TRAIN_KEYS:
        want = [(r["step"], r[key]) for r in train]
        got = tb[f"train/{key}"]
        assert [s for s, _ in got] == [s for s, _ in want], key
        for (_, a), (_, b) in zip(got, want, strict=True):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-12), key  # float32 in the event file
    evals = [(r["step"], r["val_loss"]) for r in records(run, "eval")]
    assert [s for s, _ in tb["eval/val_loss"]] == [0, 3, 6] == [s for s, _ in evals]
    assert [v for _, v in tb["eval/val_loss"]] == pytest.approx([v for _, v in evals], rel=1e-6)


def test_tensorboard_resume_replaces_the_lost_steps(tiny_job_args, tmp_path):
    """A run to step 4 with a checkpoint at 2, resumed from 2 (as after a crash that lost
    the later checkpoint): TensorBoard shows steps 3 and 4 once, the resumed run's values."""
    run = tmp_path / "tb"
    common = dict(train__steps=6, checkpoint__every=2, logging__sinks="tensorboard")
    Trainer(job(run, tiny_job_args, train__stop_at_step=4, **common)).run()
    resume = str(run / "checkpoints" / "step_00000002")
    Trainer(job(run, tiny_job_args, checkpoint__resume=resume, **common)).run()
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3, 4, 3, 4, 5, 6]
    tb = tensorboard_scalars(run)
    assert len(list((run / "tensorboard").iterdir())) == 2  # one event file per run
    last = {r["step"]: r["loss"] for r in records(run, "train")}  # the later record wins
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in tb["train/loss"]] == pytest.approx([last[s] for s in range(1, 7)])
    assert [s for s, _ in tb["eval/val_loss"]] == [0, 6]  # the first run's final eval purged


def test_wandb_offline_run_holds_the_history_and_config(tiny_job_args, tmp_path):
    run = tmp_path / "wb"
    cfg = job(run, tiny_job_args, train__steps=4, logging__sinks="wandb")
    assert cfg.logging.wandb_mode == "offline"
    Trainer(cfg).run()
    run_id = (run / "wandb" / "hyperloom-run-id").read_text().strip()
    (log,) = (run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    history, config = [], {}
    for r in wandb_records(log):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            # W&B keeps "train/loss" as the nested key ("train", "loss")
            items = r.history.item
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            )
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
    assert config["model"]["dim"] == 64 and config["train"]["steps"] == 4
    got = {h["step"]: h["train/loss"] for h in history if "train/loss" in h}
    want = {r["step"]: r["loss"] for r in records(run, "train")}
    assert got == pytest.approx(want, rel=1e-12) and sorted(got) == [1, 2, 3, 4]
    evals = {h["step"]: h["eval/val_loss"] for h in history if "eval/val_loss" in h}
    assert evals == pytest.approx({r["step"]: r["val_loss"] for r in records(run, "eval")})


def test_sinks_and_profile_are_closed_when_training_fails(tiny_job_args, tmp_path, monkeypatch):
    closed = []
    real_close = sinks_module.TensorBoardSink.close
    monkeypatch.setattr(
        sinks_module.TensorBoardSink, "close", lambda self: (closed.append(1), real_close(self))
    )
    real_step = Trainer.train_step

    def failing_step(self):
        if self.step == 2:  # step 3 fails
            raise RuntimeError("injected failure")
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", failing_step)
    run = tmp_path / "fail"
    cfg = job(
        run, tiny_job_args, train__steps=6, logging__sinks="tensorboard", logging__profile="2-4"
    )
    with pytest.raises(RuntimeError, match="injected failure"):
        Trainer(cfg).run()
    assert closed == [1]
    assert [s for s, _ in tensorboard_scalars(run)["train/loss"]] == [1, 2]
    trace = json.loads((run / "profile" / "trace_steps2-3_rank0.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e["name"].startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # 3 failed inside the window


# --------------------------------------------------------------------------- profile


def profiled_steps(trace: dict) -> dict[str, tuple[float, float]]:
    """ProfilerStep#N -> (start, end) in the trace's microseconds."""
    return {
        e["name"]: (e["ts"], e["ts"] + e["dur"])
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")
    }


def test_profile_traces_exactly_the_asked_steps(tiny_job_args, tmp_path):
    run = tmp_path / "prof"
    Trainer(job(run, tiny_job_args, train__steps=5, logging__profile="3-4")).run()
    trace = json.loads((run / "profile" / "trace_steps3-4_rank0.json").read_text())
    steps = profiled_steps(trace)
    assert sorted(steps) == ["ProfilerStep#3", "ProfilerStep#4"]
    mms = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op" and e["name"] == "aten::mm"]
    assert mms
    # every matmul of the trace ran inside one of the two steps
    assert all(any(a <= e["ts"] <= b for a, b in steps.values()) for e in mms)
    table = (run / "profile" / "ops_steps3-4_rank0.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table
    assert not list((run / "profile").glob("memory_*.pickle"))  # CUDA only


@pytest.mark.parametrize(
    ("stop", "files"),
    [
        (2, {"steps3-5": [3, 4, 5]}),  # set up after step 2, released unstarted, then all
        (3, {"steps3-3": [3], "steps4-5": [4, 5]}),  # split inside the window
    ],
)
def test_a_split_run_profiles_each_step_of_the_window_once(tiny_job_args, tmp_path, stop, files):
    run = tmp_path / "split"
    common = dict(train__steps=6, logging__profile="3-5")
    Trainer(job(run, tiny_job_args, train__stop_at_step=stop, **common)).run()
    Trainer(job(run, tiny_job_args, **common)).run()  # resumes at `stop`
    got = {
        path.name.removeprefix("trace_").removesuffix("_rank0.json"): sorted(
            int(name.removeprefix("ProfilerStep#"))
            for name in profiled_steps(json.loads(path.read_text()))
        )
        for path in (run / "profile").glob("trace_*.json")
    }
    assert got == files


def test_two_ranks_write_a_trace_each_and_one_event_file(tiny_job_args, jobs_train, tmp_path):
    args = tiny_job_args(
        tmp_path,
        train__steps=3,
        train__micro_batch_size=2,
        train__eval_batches=1,
        parallel__pp=2,
        logging__profile="2-3",
        logging__sinks="tensorboard",
    )
    result = jobs_train(tmp_path, 2, args, [("pp", [])], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "pp"
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"trace_steps2-3_rank{rank}.json").read_text())
        assert sorted(profiled_steps(trace)) == ["ProfilerStep#2", "ProfilerStep#3"], rank
        names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "cpu_op"}
        assert "aten::mm" in names, rank
        # each stage's own point-to-point traffic (activations one way, gradients back)
        assert any("send" in n for n in names) and any("recv" in n for n in names), rank
    assert len(list((run / "tensorboard").iterdir())) == 1  # the main rank's only
    assert [s for s, _ in tensorboard_scalars(run)["train/loss"]] == [1, 2, 3]


# --------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"logging__sinks": "jsonl,mlflow"}, "unknown sink 'mlflow'; choose from jsonl"),
        ({"logging__profile": "5-3"}, "'5-3' starts after it ends, at 5 > 3"),
        ({"logging__profile": "3-50"}, "'3-50' lies outside the run's steps; use 'START-END'"),
        ({"logging__profile": "0"}, "'0' lies outside the run's steps"),
        ({"logging__profile": "steps 3"}, "'steps 3' is not a step range; use"),
    ],
)
def test_bad_tracking_config_is_one_clear_line(tiny_job_args, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match="^invalid configuration: ") as err:
        job(tmp_path, tiny_job_args, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert "1-40 (train.steps)" in str(err.value) or "sinks" in str(err.value)


def test_a_sink_without_its_package_names_the_extra(tiny_job_args, tmp_path, monkeypatch):
    monkeypatch.setattr(
        sinks_module, "find_spec", lambda name: None if name == "wandb" else object()
    )
    cfg = job(tmp_path / "run", tiny_job_args, logging__sinks="tensorboard,wandb")
    built = []
    monkeypatch.setattr(Trainer, "_build_data", lambda self: built.append(1))
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert str(err.value) == (
        "invalid configuration: logging.sinks has 'wandb' but the wandb package is not "
        "installed; pip install 'hyperloom[track]'"
    )
    assert not built and not (tmp_path / "run").exists()  # before anything was built
    # W&B switched off needs no package
    sinks_module.check_sinks(
        job(tmp_path, tiny_job_args, logging__sinks="wandb", logging__wandb_mode="disabled").logging
    )


def test_cli_profile_flag_is_checked_before_training(cli, tiny_job_args, tmp_path):
    result = cli("train", "--profile", "7-9", *tiny_job_args(tmp_path, train__steps=8))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hyperloom train: error: invalid configuration: logging.profile = '7-9' lies outside "
        "the run's steps; use 'START-END' or 'STEP' within 1-8 (train.steps), or '' for none"
    ]
    assert not (tmp_path / "metrics.jsonl").exists()
