"""The FP8 resume check the data-, pipeline- and expert-parallel tests share."""

from __future__ import annotations

from pathlib import Path

import torch
from test_parallel_layouts import read_metrics  # this directory is on sys.path

from hyperloom import checkpoint as ckpt


def fp8_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The FP8 scaling state (delayed scaling's histories and scales) of a run's newest checkpoint."""
    return ckpt.load_train_state(ckpt.resolve_checkpoint(run_dir))["fp8"]


def assert_fp8_resumes(whole_dir: Path, resumed_dir: Path, stopped_at: int) -> None:
    """The run stopped at `stopped_at` and resumed takes every later step bit for bit like the
    run that went on (loss and gradient norm) and ends with the same FP8 state: the same
    weights, and the same FP8 scales on every rank only if every rank's histories were equal
    when the checkpoint kept one copy. The resumed run must have started after the stop (a
    deterministic job restarted from scratch would reach the same numbers too)."""
    whole, resumed = read_metrics(whole_dir), read_metrics(resumed_dir)
    # metrics.jsonl gathers both launches: a restart from scratch would log steps 1.. twice
    assert [r["step"] for r in resumed] == [r["step"] for r in whole]
    assert len(whole) > stopped_at
    for a, b in zip(whole[stopped_at:], resumed[stopped_at:], strict=True):
        for key in ("loss", "grad_norm"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    want, got = fp8_state(whole_dir), fp8_state(resumed_dir)
    assert want and sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
