"""Sharded (DCP) checkpoints in one process: exact resume after a crash.

`checkpoint.format = "sharded"` must change where the bytes go, not what training does: a run
killed after step 5 and resumed from its newest committed sharded checkpoint ends with the
weights and Adam state of an uninterrupted run that saved whole tensors, bit for bit. (A save
killed before its commit: test_resilience_checkpoint.py; multi-rank saves, resharding and
corrupted shards: tests/distributed/test_sharded_checkpoint.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyperloom import checkpoint as ckpt
from hyperloom.checkpoint import is_sharded
from hyperloom.checkpoint.sharded import load_full
from hyperloom.config import load_config
from hyperloom.resilience.inject import CRASH_EXIT
from hyperloom.train.trainer import Trainer

STEPS = 10
COMMON = dict(train__steps=STEPS, checkpoint__every=2, checkpoint__keep=3)
SHARDED = dict(checkpoint__format="sharded", checkpoint__async_save=True)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_model_state(ckpt.checkpoint_root(run_dir) / f"step_{STEPS:08d}")


@pytest.fixture(scope="module")
def whole_reference(tmp_path_factory, tiny_job_args) -> Path:
    run_dir = tmp_path_factory.mktemp("whole")
    Trainer(load_config(None, tiny_job_args(run_dir, **COMMON))).run()
    return run_dir


def test_sharded_crash_and_resume_equals_an_uninterrupted_whole_run(
    whole_reference, tiny_job_args, cli, tmp_path
):
    args = tiny_job_args(tmp_path, **COMMON, **SHARDED)
    proc = cli("train", *args, "--resilience.inject", "crash@5")
    assert proc.returncode == CRASH_EXIT, proc.stderr[-2000:]
    # Step 4's background save may or may not have committed before the kill.
    latest, _ = ckpt.latest_verified(tmp_path)
    assert ckpt.checkpoint_step(latest) in (2, 4) and is_sharded(latest)
    cfg = load_config(None, args + ["--resilience.inject", "crash@5"])
    s = Trainer(cfg).run().summary
    assert (s["steps"], s["steps_this_run"]) == (STEPS, STEPS - ckpt.checkpoint_step(latest))
    a, b = final_weights(tmp_path), final_weights(whole_reference)
    assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)
    # and the optimizer state, which the whole format keeps in train_state.pt
    step = ckpt.checkpoint_root(tmp_path) / f"step_{STEPS:08d}"
    whole = ckpt.load_train_state(ckpt.checkpoint_root(whole_reference) / step.name)
    opt = load_full(step)[1]["state"]
    ref = whole["optimizer"]["state"]
    assert all(torch.equal(opt[n][k], ref[n][k]) for n in ref for k in ref[n])
