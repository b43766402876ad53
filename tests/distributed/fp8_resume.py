"""The FP8 resume check the data-, pipeline- and expert-parallel tests share."""

from __future__ import annotations

from pathlib import Path

import torch
from test_parallel_layouts import read_metrics  # this directory is on sys.path

from hyperloom.train import checkpoint as ckpt


def fp8_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The FP8 scaling state (delayed scaling's histories and scales) of a run's newest checkpoint."""
    return ckpt.load_train_state(ckpt.resolve_checkpoint(run_dir))["fp8"]


def assert_fp8_resumes(
    whole_dir: Path, resumed_dir: Path, stopped_at: int, later: float = 0
) -> None:
    """The run stopped at `stopped_at` and resumed takes the next step bit for bit like the
    run that went on (same weights, and the same FP8 scales on every rank only if every
    rank's histories were equal when the checkpoint kept one copy), and the steps after it
    within `later` (relative; 0: bit for bit, and then it ends with the same FP8 state; after
    a drift, routing flips move single experts' amaxes by more than `later`, so the state is
    only compared bit for bit). Loss and gradient norm are compared at every step, and the
    resumed run must have started after the stop (a deterministic job restarted from scratch
    would reach the same numbers too)."""
    whole, resumed = read_metrics(whole_dir), read_metrics(resumed_dir)
    steps = [r["step"] for r in whole]
    # metrics.jsonl gathers both launches: a restart from scratch would log steps 1.. twice
    assert [r["step"] for r in resumed] == steps
    first, *rest = zip(whole[stopped_at:], resumed[stopped_at:], strict=True)
    assert (first[0]["loss"], first[0]["grad_norm"]) == (first[1]["loss"], first[1]["grad_norm"])
    for a, b in rest:
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= later * abs(a[key]), (a["step"], key, a[key], b[key])
    want, got = fp8_state(whole_dir), fp8_state(resumed_dir)
    assert want and sorted(got) == sorted(want)
    assert later or all(torch.equal(got[k], want[k]) for k in want)
