"""Checkpoint integrity and exact resume: commit protocol, fallback, async bytes, crash drills.

The crash is real: `python -m hyperloom train --resilience.inject crash@5` dies with
`os._exit` (like `kill -9`) after step 5, between the checkpoints of steps 4 and 6; the same
command again resumes from step 4. The final parameters must equal an uninterrupted run's bit
for bit, and a resume that does not restore the data position must not (the negative
control: without it the bitwise check could be vacuous). The tiny Llama has no dropout by
default, so it draws no random numbers while training and a resume without the RNG streams
would pass; with `model.dropout` > 0 every step draws masks, and the second negative control
shows that a resume which skips restoring the RNG streams fails the same check.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hyperloom import checkpoint as ckpt
from hyperloom.checkpoint import CheckpointWriter
from hyperloom.checkpoint.sharded import ShardedCheckpointWriter
from hyperloom.config import load_config
from hyperloom.data import ResumableLoader
from hyperloom.resilience.events import json_events
from hyperloom.resilience.inject import CRASH_EXIT, FaultInjector, WriterCrash
from hyperloom.train.trainer import Trainer

STEPS = 10
COMMON = dict(train__steps=STEPS, checkpoint__every=2, checkpoint__keep=3)


def job(run_dir: Path, tiny_job_args, **overrides):
    return load_config(None, tiny_job_args(run_dir, **{**COMMON, **overrides}))


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.checkpoint_root(run_dir) / f"step_{STEPS:08d}/model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_job_args) -> Path:
    run_dir = tmp_path_factory.mktemp("reference")
    Trainer(job(run_dir, tiny_job_args)).run()
    return run_dir


@pytest.fixture(scope="module")
def crashed(tmp_path_factory, tiny_job_args, cli) -> Path:
    """A run killed after step 5 by the crash drill (checkpoints at 2 and 4 committed)."""
    run_dir = tmp_path_factory.mktemp("crashed")
    proc = cli("train", *tiny_job_args(run_dir, **COMMON), "--resilience.inject", "crash@5")
    assert proc.returncode == CRASH_EXIT, proc.stderr[-2000:]
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["step_00000002", "step_00000004"]
    return run_dir


def test_crash_and_auto_resume_is_bitwise_equal(crashed, reference, tiny_job_args, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(crashed, run_dir)
    s = Trainer(job(run_dir, tiny_job_args, resilience__inject="crash@5")).run().summary
    assert (s["steps"], s["steps_this_run"]) == (STEPS, STEPS - 4)  # fired once, not again
    assert_same_weights(final_weights(run_dir), final_weights(reference))


def test_negative_control_resume_without_data_position_differs(
    crashed, reference, tiny_job_args, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    shutil.copytree(crashed, run_dir)
    monkeypatch.setattr(ResumableLoader, "load_state_dict", lambda self, state: None)
    Trainer(job(run_dir, tiny_job_args)).run()
    a, b = final_weights(run_dir), final_weights(reference)
    assert not all(torch.equal(a[n], b[n]) for n in a)


DROPOUT = dict(model__dropout=0.1)


@pytest.fixture(scope="module")
def dropout_reference(tmp_path_factory, tiny_job_args) -> Path:
    run_dir = tmp_path_factory.mktemp("dropout-reference")
    Trainer(job(run_dir, tiny_job_args, **DROPOUT)).run()
    return run_dir


@pytest.fixture(scope="module")
def dropout_crashed(tmp_path_factory, tiny_job_args, cli) -> Path:
    """As `crashed`, with dropout: the RNG streams at step 4 are part of the state."""
    run_dir = tmp_path_factory.mktemp("dropout-crashed")
    args = tiny_job_args(run_dir, **COMMON, **DROPOUT)
    proc = cli("train", *args, "--resilience.inject", "crash@5")
    assert proc.returncode == CRASH_EXIT, proc.stderr[-2000:]
    return run_dir


def test_with_dropout_crash_and_auto_resume_is_bitwise_equal(
    dropout_crashed, dropout_reference, reference, tiny_job_args, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(dropout_crashed, run_dir)
    Trainer(job(run_dir, tiny_job_args, resilience__inject="crash@5", **DROPOUT)).run()
    assert_same_weights(final_weights(run_dir), final_weights(dropout_reference))
    a, b = final_weights(dropout_reference), final_weights(reference)
    assert not all(torch.equal(a[n], b[n]) for n in a)  # dropout did change training


def test_negative_control_resume_without_rng_differs(
    dropout_crashed, dropout_reference, tiny_job_args, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    shutil.copytree(dropout_crashed, run_dir)
    monkeypatch.setattr(ckpt, "restore_rng", lambda state: None)  # data position restored
    Trainer(job(run_dir, tiny_job_args, **DROPOUT)).run()
    a, b = final_weights(run_dir), final_weights(dropout_reference)
    assert not all(torch.equal(a[n], b[n]) for n in a)


def test_async_save_writes_the_same_bytes_as_a_sync_save(tiny_job_args, tmp_path):
    dirs = {}
    for mode in ("sync", "async"):
        random.seed(0)  # the checkpoint holds the host RNG streams, which tests before moved
        np.random.seed(0)
        dirs[mode] = tmp_path / mode
        cfg = job(dirs[mode], tiny_job_args, checkpoint__async_save=mode == "async")
        Trainer(cfg).run()
    for step in (6, 8, 10):
        a, b = (ckpt.checkpoint_root(dirs[m]) / f"step_{step:08d}" for m in ("sync", "async"))
        for f in ("model.safetensors", "train_state.pt"):
            assert (a / f).read_bytes() == (b / f).read_bytes(), (step, f)
        # config.toml differs in checkpoint.async_save itself; every other file's hash agrees
        hashes = [ckpt.verify_checkpoint(d)["sha256"] for d in (a, b)]
        assert [{k: v for k, v in h.items() if k != "config.toml"} for h in hashes] == [
            {k: v for k, v in hashes[0].items() if k != "config.toml"}
        ] * 2


def _break(kind: str, ckpt_dir: Path) -> None:
    if kind == "corrupt":  # flip one byte in the middle of the weights
        f = ckpt_dir / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif kind == "truncate":
        f = ckpt_dir / "train_state.pt"
        f.write_bytes(f.read_bytes()[:100])
    elif kind == "uncommitted":  # the commit record is missing
        (ckpt_dir / "meta.json").unlink()
    elif kind == "interrupted":  # what a kill mid-save leaves: step_N.tmp beside step_N-2
        ckpt_dir.rename(ckpt_dir.with_name(ckpt_dir.name + ".tmp"))
    elif kind == "no_manifest":  # a commit record without its SHA-256 map, weights damaged
        meta = json.loads((ckpt_dir / "meta.json").read_text())
        del meta["sha256"]
        (ckpt_dir / "meta.json").write_text(json.dumps(meta))
        _break("corrupt", ckpt_dir)
    elif kind == "list_meta":  # a commit record of the wrong JSON type
        (ckpt_dir / "meta.json").write_text("[1, 2]")
    elif kind == "garbage_meta":
        (ckpt_dir / "meta.json").write_bytes(bytes(range(256)))


@pytest.mark.parametrize(
    "kind",
    [
        "corrupt",
        "truncate",
        "uncommitted",
        "interrupted",
        "no_manifest",
        "list_meta",
        "garbage_meta",
    ],
)
def test_a_broken_latest_checkpoint_is_never_loaded(kind, reference, tiny_job_args, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    _break(kind, ckpt.checkpoint_root(run_dir) / f"step_{STEPS:08d}")
    trainer = Trainer(job(run_dir, tiny_job_args, train__steps=STEPS + 2))
    trainer.maybe_resume()
    assert trainer.resumed_from.name == f"step_{STEPS - 2:08d}" and trainer.step == STEPS - 2
    trainer.guard.close()
    (fallback,) = json_events(run_dir, "checkpoint_fallback") or [None]
    (line,) = (run_dir / "events.log").read_text().splitlines()
    skipped, using = line.split("[checkpoint_fallback] not loading ")[1].split("; using ")
    assert f"step_{STEPS:08d}" in skipped and using == f"step_{STEPS - 2:08d}"  # both named
    assert fallback is None  # the Reporter did not exist yet: events.log has it, told at once


@pytest.mark.parametrize("writer_cls", [CheckpointWriter, ShardedCheckpointWriter])
def test_a_write_that_fails_once_is_retried_from_the_staged_copy(writer_cls, tmp_path):
    key = "w" if writer_cls is CheckpointWriter else "model/w"  # the sharded format's name
    state = {key: torch.arange(4.0)}
    for async_save in (False, True):
        root = tmp_path / str(async_save)
        writer = writer_cls(root, keep=2, async_save=async_save)
        writer.save(2, state, {"step": 2}, {}, {})
        writer.wait()
        left = []

        def killed(left=left, root=root) -> None:
            left.append(sorted(p.name for p in ckpt.checkpoint_root(root).iterdir()))
            raise SystemExit("died mid-save")  # a thread cannot os._exit the test

        failures = []
        writer.on_failure = lambda *report, out=failures: out.append(report)
        writer.save(4, state, {"step": 4}, {}, {}, after_first_file=killed)
        state[key].add_(1.0)  # the next step, while an async retry may still be writing
        writer.wait()
        state[key].sub_(1.0)
        assert left == [["step_00000002", "step_00000004.tmp"]]  # the fault struck mid-save
        ((step, exc, committed),) = failures
        assert (step, str(exc), committed) == (4, "died mid-save", True)
        assert ckpt.latest_verified(root) == (ckpt.checkpoint_root(root) / "step_00000004", [])
        assert ckpt.load_model_state(ckpt.checkpoint_dir(root, 4))["w"].equal(torch.arange(4.0))


@pytest.mark.parametrize("writer_cls", [CheckpointWriter, ShardedCheckpointWriter])
def test_a_crashed_async_writer_leaves_nothing_and_its_retry_commits(writer_cls, tmp_path):
    state = {"w": torch.arange(4.0)}
    failures: list[tuple[int, BaseException, bool]] = []
    writer = writer_cls(tmp_path, keep=2, async_save=True, on_failure=lambda *r: failures.append(r))
    writer.save(2, state, {"step": 2}, {}, {})
    crash = FaultInjector("writer_crash@4", tmp_path, rank=0).save_fault(4)
    on_main_thread = []

    def crash_here() -> None:
        on_main_thread.append(threading.current_thread() is threading.main_thread())
        crash()

    writer.save(4, state, {"step": 4}, {}, {}, after_first_file=crash_here)
    writer.wait()
    assert on_main_thread == [False]  # the background writer died, not the training thread
    ((step, exc, committed),) = failures
    assert step == 4 and isinstance(exc, WriterCrash) and committed  # by the retry
    assert sorted(p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]  # and nothing of the attempt that died is left
    writer.save(6, state, {"step": 6}, {}, {})
    writer.wait()
    assert len(failures) == 1
    assert ckpt.committed_steps(tmp_path) == [4, 6]


@pytest.mark.parametrize("fmt", ["whole", "sharded"])
def test_writer_crash_then_a_crash_resumes_bitwise(fmt, reference, tiny_job_args, cli, tmp_path):
    """The writer_crash drill's run: step 4's async save dies half-way, its retry commits,
    training goes on, the process is killed after step 7; the resume ends bit for bit."""
    args = tiny_job_args(tmp_path, **COMMON, checkpoint__async_save=True, checkpoint__format=fmt)
    args += ["--resilience.inject", "writer_crash@4,crash@7"]
    proc = cli("train", *args)
    assert proc.returncode == CRASH_EXIT, proc.stderr[-2000:]
    log = (tmp_path / "events.log").read_text()
    assert "[checkpoint_failed] writing the checkpoint of step 4 failed (WriterCrash: " in log
    assert "; the retry committed it" in log
    committed = [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path)]
    assert committed in ([2, 4], [2, 4, 6])  # step 6's save may still have been in flight
    s = Trainer(load_config(None, args)).run().summary
    assert (s["steps"], s["steps_this_run"]) == (STEPS, STEPS - committed[-1])
    final = ckpt.checkpoint_root(tmp_path) / f"step_{STEPS:08d}"
    assert_same_weights(ckpt.load_model_state(final), final_weights(reference))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_disk_full_once_mid_save_costs_nothing(async_save, reference, tiny_job_args, tmp_path):
    """ENOSPC half-way through step 4's save, once: the retry commits it, the run goes on and
    ends bitwise as the clean one, and the event says what happened."""
    cfg = job(
        tmp_path, tiny_job_args, checkpoint__async_save=async_save, resilience__inject="disk_full@4"
    )
    s = Trainer(cfg).run().summary
    assert s["steps"] == STEPS
    (failed,) = json_events(tmp_path, "checkpoint_failed")
    (line,) = (tmp_path / "events.log").read_text().splitlines()
    assert failed["step"] == 4 and line.endswith(
        "[checkpoint_failed] writing the checkpoint of step 4 failed (No space left on device "
        "(injected by the disk_full drill)); the retry committed it"
    )
    names = [p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()]
    assert sorted(names) == ["step_00000006", "step_00000008", "step_00000010"]  # .tmp cleaned
    assert_same_weights(final_weights(tmp_path), final_weights(reference))


def test_staging_copies_so_later_updates_do_not_leak_into_the_save(tmp_path):
    w = torch.zeros(1 << 16)
    writer = CheckpointWriter(tmp_path, keep=1, async_save=True)
    writer.save(1, {"w": w}, {"m": w}, {}, {})
    w.add_(1.0)  # the next optimizer step, while the writer may still be writing
    writer.wait()
    saved = ckpt.load_model_state(ckpt.checkpoint_root(tmp_path) / "step_00000001")
    assert torch.equal(saved["w"], torch.zeros(1 << 16))
