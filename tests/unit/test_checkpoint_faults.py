"""No fault may cost a good checkpoint: commit records that vouch for nothing, unreadable
checkpoints, non-finite state, writes that fail (a full volume), an import over a run.

Where the exit status is the point, the real CLI runs in a subprocess. A full volume is made
real with the file size limit (RLIMIT_FSIZE, `ulimit -f`): a write past it fails with EFBIG,
which Python (it ignores SIGXFSZ) sees as an OSError, as it would ENOSPC.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyperloom import checkpoint as ckpt
from hyperloom.checkpoint import CheckpointWriter
from hyperloom.checkpoint.commit import commit
from hyperloom.checkpoint.whole import _torch_save
from hyperloom.config import load_config
from hyperloom.resilience.events import json_events
from hyperloom.resilience.policy import TrainingHalted
from hyperloom.train.trainer import Trainer

SIZE_LIMIT = 200_000  # bytes: above config.toml and metrics, below the tiny model's weights


def tree(path: Path) -> dict[str, str]:
    """Every file under `path` with its SHA-256: a directory is unchanged iff this is."""
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.rglob("*"))
        if f.is_file()
    }


def train_limited(args: list[str], limit: int) -> subprocess.CompletedProcess:
    """`hyperloom train ARGS` with files limited to `limit` bytes (`ulimit -f`)."""

    def cap() -> None:
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )

    return subprocess.run(
        [sys.executable, "-m", "hyperloom", "train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=cap,
    )


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one-line error a failing command ends with (no traceback anywhere)."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "inline_container" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("hyperloom train: error: "), proc.stderr[-3000:]
    return line.removeprefix("hyperloom train: error: ")


# --------------------------------------------------------------------------- commit records


def two_checkpoints(root: Path) -> Path:
    """Committed checkpoints of steps 2 and 4 (a tiny state); returns step 4's."""
    writer = CheckpointWriter(root, keep=5, async_save=False)
    for step in (2, 4):
        writer.save(step, {"w": torch.full((64,), float(step))}, {"step": step}, {}, {})
    return ckpt.checkpoint_dir(root, 4)


def _edit_meta(ckpt_dir: Path, edit) -> None:
    meta = json.loads((ckpt_dir / "meta.json").read_text())
    edit(meta)
    (ckpt_dir / "meta.json").write_text(json.dumps(meta))


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGE = {
    # A record without its SHA-256 map, over damaged weights: it vouches for nothing.
    "no manifest": lambda d: (
        _edit_meta(d, lambda m: m.pop("sha256")),
        _flip(d / "model.safetensors"),
    ),
    "empty manifest": lambda d: _edit_meta(d, lambda m: m.update(sha256={})),
    "manifest without the weights": lambda d: _edit_meta(
        d, lambda m: m["sha256"].pop("model.safetensors")
    ),
    "manifest with a path": lambda d: _edit_meta(
        d, lambda m: m["sha256"].update({"../x": "0" * 64})
    ),
    "list": lambda d: (d / "meta.json").write_text("[1, 2]"),
    "string": lambda d: (d / "meta.json").write_text('"step 4"'),
    "null": lambda d: (d / "meta.json").write_text("null"),
    "garbage bytes": lambda d: (d / "meta.json").write_bytes(bytes(range(255, -1, -1))),
    "empty": lambda d: (d / "meta.json").write_text(""),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_commit_record_that_vouches_for_nothing_is_a_corrupt_checkpoint(damage, tmp_path):
    step4 = two_checkpoints(tmp_path)
    DAMAGE[damage](step4)
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint {step4}: "):
        ckpt.verify_checkpoint(step4)
    latest, (why,) = ckpt.latest_verified(tmp_path)
    assert latest == ckpt.checkpoint_dir(tmp_path, 2)
    assert why.startswith(f"checkpoint {step4}: ")  # the message names what it passed over


def test_an_unreadable_checkpoint_is_passed_over_with_its_name(tmp_path, monkeypatch):
    step4 = two_checkpoints(tmp_path)
    real_listdir = os.listdir

    def listdir(path):
        if Path(path) == step4:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    latest, rejected = ckpt.latest_verified(tmp_path)
    assert latest.name == "step_00000002"
    assert rejected == ["step_00000004 cannot be read (Permission denied)"]


def test_an_unreadable_file_of_a_checkpoint_is_passed_over_with_its_name(tmp_path, monkeypatch):
    step4 = two_checkpoints(tmp_path)
    real_open = Path.open

    def open_(self, *args, **kwargs):
        if self == step4 / "model.safetensors":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    latest, rejected = ckpt.latest_verified(tmp_path)
    assert latest.name == "step_00000002"
    assert rejected == [f"checkpoint {step4}: cannot read model.safetensors: Permission denied"]


def _unprivileged() -> list[str]:
    """A command prefix under which file permissions hold (root bypasses them: drop its
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH), or skip the test."""
    if os.geteuid() != 0:
        return []
    drop = "-dac_override,-dac_read_search"
    prefix = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}"]
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions cannot be tested")
    probe = subprocess.run([*prefix, "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"setpriv cannot drop capabilities here: {probe.stderr!r}")
    return prefix


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_job_args, cli) -> Path:
    """A run of 4 steps with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("finished")
    proc = cli("train", *tiny_job_args(run_dir, train__steps=4, checkpoint__every=2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("what", ["directory", "weights"])
def test_a_resume_passes_over_a_checkpoint_it_may_not_read(what, finished, tiny_job_args, tmp_path):
    """chmod 000 on the newest checkpoint (or its weights): the run falls back to the one
    before, says which it passed over and why, and finishes."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    step4 = ckpt.checkpoint_dir(run_dir, 4)
    (step4 if what == "directory" else step4 / "model.safetensors").chmod(0)
    try:
        args = tiny_job_args(run_dir, train__steps=6)  # no periodic save would replace step 4
        proc = subprocess.run(
            [*_unprivileged(), sys.executable, "-m", "hyperloom", "train", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        step4.chmod(0o755)
        (step4 / "model.safetensors").chmod(0o644)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = (run_dir / "events.log").read_text().splitlines()
    why = (
        "step_00000004 cannot be read (Permission denied)"
        if what == "directory"
        else f"checkpoint {step4}: cannot read model.safetensors: Permission denied"
    )
    assert line.endswith(f"[checkpoint_fallback] not loading {why}; using step_00000002")
    assert json.loads((run_dir / "summary.json").read_text())["steps_this_run"] == 4


# --------------------------------------------------------------------------- non-finite state


def _tiny_trainer(run_dir: Path, tiny_job_args, **overrides) -> Trainer:
    return Trainer(load_config(None, tiny_job_args(run_dir, **overrides)))


def test_nonfinite_state_names_the_tensors_that_hold_nan_or_inf(tiny_job_args, tmp_path):
    trainer = _tiny_trainer(tmp_path, tiny_job_args, train__steps=1)
    trainer.train_step()  # the optimizer has state now
    assert ckpt.nonfinite_state(trainer.pm, trainer.optimizer) == []
    params = dict(trainer.pm.local_params())
    with torch.no_grad():
        params["layers.1.feed_forward.w2.weight"].view(-1)[7] = float("nan")
        trainer.optimizer.state[params["norm.weight"]]["exp_avg_sq"][0] = float("inf")
    assert ckpt.nonfinite_state(trainer.pm, trainer.optimizer) == [
        "layers.1.feed_forward.w2.weight",
        "norm.weight (optimizer exp_avg_sq)",
    ]
    # A sum that overflows is not a non-finite tensor: the exact check rules it out.
    with torch.no_grad():
        params["layers.1.feed_forward.w2.weight"].fill_(3e38)
    assert ckpt.nonfinite_state(trainer.pm, trainer.optimizer) == [
        "norm.weight (optimizer exp_avg_sq)"
    ]
    trainer.guard.close()


def test_a_checkpoint_is_never_written_from_nonfinite_state(tiny_job_args, tmp_path):
    trainer = _tiny_trainer(tmp_path, tiny_job_args, train__steps=2, checkpoint__every=1)
    trainer.train_step()
    assert trainer.save(None) == ckpt.checkpoint_dir(tmp_path, 1)
    trainer.train_step()
    with torch.no_grad():
        next(iter(trainer.pm.local_params()))[1].view(-1)[0] = float("inf")
    assert trainer.save(None) is None  # refused: an event, no checkpoint
    with pytest.raises(TrainingHalted, match="checkpoint step 2 was not written: the param"):
        trainer.save(None, wait=True)  # the final save: the run stops
    trainer.guard.close()
    assert ckpt.committed_steps(tmp_path) == [1]
    assert not ckpt.staging_dir(tmp_path, 2).exists()
    log = (tmp_path / "events.log").read_text()
    assert log.count("[checkpoint_refused] checkpoint step 2 was not written") == 2
    assert "(tok_embeddings.weight); the newest good checkpoint is step 1" in log


def test_nan_weights_never_replace_the_good_checkpoints(tiny_job_args, cli, tmp_path):
    """NaN gradients at step 5 with no anomaly checks make every weight NaN: the saves of
    steps 6 and 8 are refused, so rotation (keep = 2) never drops steps 2 and 4, and the run
    ends with exit status 2, not with a NaN checkpoint."""
    args = tiny_job_args(tmp_path, train__steps=10, checkpoint__every=2, checkpoint__keep=2)
    args += ["--resilience.on_anomaly", "none", "--resilience.inject", "nan_grad@5"]
    proc = cli("train", *args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ckpt.committed_steps(tmp_path) == [2, 4]
    refused = json_events(tmp_path, "checkpoint_refused")
    assert [r["step"] for r in refused] == [6, 8]
    assert not (tmp_path / "summary.json").exists()
    for step in (2, 4):
        weights = ckpt.load_model_state(ckpt.checkpoint_dir(tmp_path, step))
        assert all(torch.isfinite(t).all() for t in weights.values())


def test_pruning_spares_the_protected_checkpoint(tmp_path):
    for step in (2, 4, 6):
        tmp = ckpt.staging_dir(tmp_path, step)
        tmp.mkdir(parents=True)
        (tmp / "w").write_text(str(step))
        commit(tmp_path, step, {}, {}, keep=1, protect=frozenset([2]))
    assert ckpt.committed_steps(tmp_path) == [2, 6]


def test_a_save_is_never_pruned_by_checkpoints_newer_than_it(tmp_path):
    """A run resumed from an older checkpoint (checkpoint.resume = PATH) saves beside newer
    ones of another timeline: pruning counts back from the save, so it stays, and the newer
    ones are not this save's to delete."""
    writer = CheckpointWriter(tmp_path, keep=2, async_save=False)
    for step in (2, 4, 6, 8):
        writer.save(step, {"w": torch.zeros(2)}, {"step": step}, {}, {})
    assert ckpt.committed_steps(tmp_path) == [6, 8]
    writer.save(4, {"w": torch.ones(2)}, {"step": 4}, {}, {})  # resumed from step 2's
    assert ckpt.committed_steps(tmp_path) == [4, 6, 8]
    assert ckpt.load_model_state(ckpt.checkpoint_dir(tmp_path, 4))["w"].equal(torch.ones(2))
    writer.save(6, {"w": torch.ones(2)}, {"step": 6}, {}, {})  # replaces the other step 6
    assert ckpt.committed_steps(tmp_path) == [4, 6, 8]


def test_the_newest_stable_checkpoint_outlives_checkpoint_keep(tiny_job_args, tmp_path):
    """keep = 1, a NaN gradient at step 7 (skipped): step 8's checkpoint is the newest one
    followed by `stable_steps` healthy steps when step 10's is written, so it is kept."""
    cfg = load_config(
        None,
        tiny_job_args(
            tmp_path,
            train__steps=10,
            checkpoint__every=2,
            checkpoint__keep=1,
            resilience__stable_steps=2,
            resilience__inject="nan_grad@7",
        ),
    )
    Trainer(cfg).run()
    assert ckpt.committed_steps(tmp_path) == [8, 10]


def test_a_rollback_never_loads_a_damaged_checkpoint(tiny_job_args, tmp_path, monkeypatch):
    """The stable checkpoint a rollback would return to (step 4) is damaged after it was
    written: the rollback passes over it, with an event naming it, to step 2."""
    cfg = load_config(
        None,
        tiny_job_args(
            tmp_path,
            train__steps=10,
            checkpoint__every=2,
            checkpoint__keep=3,
            resilience__on_anomaly="rollback",
            resilience__stable_steps=2,
            resilience__inject="nan_grad@7",
        ),
    )
    save = Trainer.save

    def save_then_damage(self, last_loss, wait=False):
        path = save(self, last_loss, wait)
        if self.step == 6:  # bit rot in step 4's weights, after its commit
            _flip(ckpt.checkpoint_dir(tmp_path, 4) / "model.safetensors")
        return path

    monkeypatch.setattr(Trainer, "save", save_then_damage)
    Trainer(cfg).run()
    (rollback,) = json_events(tmp_path, "rollback")
    assert rollback["target"] == 2
    (fallback,) = json_events(tmp_path, "checkpoint_fallback")
    assert fallback["step"] == 7
    step4 = ckpt.checkpoint_dir(tmp_path, 4)
    assert (
        f"[checkpoint_fallback] not rolling back to checkpoint {step4}: model.safetensors "
        in (tmp_path / "events.log").read_text()
    )


# --------------------------------------------------------------------------- failed writes


def test_torch_save_failures_carry_the_file_system_error(tmp_path):
    """torch.save reports a failed write as "[enforce fail at inline_container.cc] unexpected
    pos"; the checkpoint writer raises the OSError underneath instead."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (SIZE_LIMIT, hard))
    try:
        with pytest.raises(OSError) as failed:
            _torch_save({"x": torch.zeros(SIZE_LIMIT)}, tmp_path / "state.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert failed.value.errno == errno.EFBIG
    assert ckpt.describe_failure(failed.value).startswith("File too large")


@pytest.mark.parametrize("writer_cls", ["whole", "sharded"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_write_that_fails_twice_is_reported_and_leaves_nothing(writer_cls, async_save, tmp_path):
    if writer_cls == "sharded":
        from hyperloom.checkpoint.sharded import ShardedCheckpointWriter as cls
    else:
        cls = CheckpointWriter
    writer = cls(tmp_path, keep=2, async_save=async_save)
    key = "model/w" if writer_cls == "sharded" else "w"
    writer.save(2, {key: torch.zeros(8)}, {"step": 2}, {}, {})
    writer.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (SIZE_LIMIT, hard))
    try:
        with pytest.raises(ckpt.CheckpointError) as failed:
            writer.save(4, {key: torch.zeros(SIZE_LIMIT)}, {"step": 4}, {}, {})
            writer.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    root = ckpt.checkpoint_root(tmp_path)
    assert str(failed.value).startswith(f"checkpoint step 4 could not be written to {root}: File")
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]


@pytest.mark.parametrize(
    "fmt,async_save,every",
    [("whole", False, 2), ("whole", True, 2), ("sharded", True, 2), ("whole", False, 0)],
    ids=["whole-sync", "whole-async", "sharded-async", "final-save"],
)
def test_a_full_disk_stops_the_run_and_keeps_the_good_checkpoints(
    fmt, async_save, every, finished, tiny_job_args, tmp_path
):
    """Every write past the size limit fails (the weights of step 6 on): the run stops with
    exit status 2 and one line that names the lost step, the reason and the checkpoint to
    resume from; that checkpoint and the one before are untouched; nothing half-written is
    left; no summary.json names a checkpoint that is not there."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    if fmt == "sharded":  # a sharded run of its own, with its own good checkpoints
        shutil.rmtree(run_dir)
        first = tiny_job_args(run_dir, train__steps=4, checkpoint__every=2, checkpoint__format=fmt)
        assert train_limited(first, resource.RLIM_INFINITY).returncode == 0
    good = tree(ckpt.checkpoint_root(run_dir))
    args = tiny_job_args(
        run_dir,
        train__steps=8,
        checkpoint__every=every,
        checkpoint__async_save=async_save,
        checkpoint__format=fmt,
    )
    proc = train_limited(args, SIZE_LIMIT)
    lost = 6 if every else 8
    assert error_line(proc) == (
        f"checkpoint step {lost} could not be written to {ckpt.checkpoint_root(run_dir)}: File "
        "too large (a file reached the size limit, ulimit -f); the newest good checkpoint is "
        "step 4"
    )
    assert tree(ckpt.checkpoint_root(run_dir)) == good  # kept, and nothing else there
    assert not (run_dir / "summary.json").exists()
    failed = [x for x in (run_dir / "events.log").read_text().splitlines() if "_failed]" in x]
    assert len(failed) == 1 and f" step {lost} [checkpoint_failed] checkpoint step" in failed[0]


def test_a_run_directory_that_cannot_be_written_is_one_line(tiny_job_args, tmp_path):
    """A volume too full for config.toml: exit status 2 and a line naming the file."""
    proc = train_limited(tiny_job_args(tmp_path, train__steps=2), 4096)
    assert error_line(proc) == f"cannot write {tmp_path / 'config.toml'}: File too large"


@pytest.mark.parametrize("name", ["metrics.jsonl", "events.log", "restarts.json", "summary.json"])
def test_a_log_that_cannot_be_written_is_one_line(name, finished, tiny_job_args, tmp_path):
    """A file of the run that cannot be written (here a directory in its place; a read-only
    file is the same OSError): exit status 2, one line naming it."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    (run_dir / name).unlink(missing_ok=True)
    (run_dir / name).mkdir()
    meta = ckpt.checkpoint_dir(run_dir, 4) / "meta.json"
    meta.write_text("[]")  # the fallback is an event: events.log is written at once
    proc = train_limited(tiny_job_args(run_dir, train__steps=6), resource.RLIM_INFINITY)
    assert error_line(proc) == f"cannot write {run_dir / name}: Is a directory"
