"""Delayed FP8 scaling under DualPipe and DualPipeV equals one process when the scales move
once per optimizer step (`precision.fp8_delayed_update = "step"`), and resumes bit for bit.

Each pipeline rank holds two copies of chunks that run micro-batches at the same time. With
the default "microbatch" update a copy's scales move with its own micro-batches only, which
no history rolling per micro-batch can make equal to one process. Under "step" every
quantization of a step uses the scale of the step's start and records its amax by max; the
copies (and dp replicas) reduce their current slot after the schedule and the trainer's
`end_fp8_step` moves every scale once. So a pp = 2 run takes one process's scales.

All runs are the real Trainer (`jobs_worker.py`): pp = 2 with 4 micro-batches of one row
against one process with `grad_accum = 4` of one row, fp32, AdamW, 6 steps, every linear but
embedding, head and norms in FP8 (hybrid: E5M2 gradients). The pp runs share one 2-process
launch, the references one plain process. Measured (AMD EPYC, pytest's one-thread
environment), relative to one process:

- DualPipeV "step": every loss and gradient norm bit for bit, and the final amax histories
  and scales too. DualPipe "step": losses <= 7.9e-8 (the step loss summed in another order),
  gradient norms bit for bit, histories and scales <= 2.3e-9 of their largest value.
  Asserted 1e-6 for steps 1-2 and 1e-5 after (another CPU may flip an FP8 rounding once the
  weights differ in a last bit, test_fp8_pipeline_parallel.py), state 1e-6.
- DualPipe "microbatch" (the default, unchanged): losses up to 1.8e-3, gradient norms up
  to 3.0e-2 away (3.7e-5 and 4.1e-3 at step 1); asserted to stay >= 1e-4, so the bounds
  above can fail.
- pp2 x dp2 DualPipe "step" (4 processes, against `grad_accum = 8`, forward GEMMs in FP8):
  steps 1-4 <= 1.2e-7, then 5.5e-5 and 3.4e-4 (gradient norms) as the dp mean of the
  gradients, summed in another order, moves a last bit; asserted 1e-6, then 1e-3.
- A DualPipeV "step" run stopped at step 3 and resumed takes steps 4-6 bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import override_args
from fp8_resume import assert_fp8_resumes, fp8_state  # this directory is on sys.path
from test_parallel_layouts import read_metrics

STEPS = 6
JOB = {
    "model__dim": 64,
    "model__n_layers": 4,  # DualPipeV's 4 chunks over pp = 2
    "model__n_heads": 4,
    "model__n_kv_heads": 4,
    "model__ffn_dim": 128,
    "data__seq_len": 32,
    "train__steps": STEPS,
    "train__warmup_steps": 2,
    "train__micro_batch_size": 1,
    "precision__fp8": "delayed",
}
STEP = {"precision__fp8_delayed_update": "step"}
PP2 = {"parallel__pp": 2, "parallel__microbatches": 4}
EQUAL_FIRST = 1e-6  # steps 1-2: losses and grad norms vs one process (module docstring)
EQUAL_AFTER = 1e-5  # steps 3-6 under pp = 2
DP_AFTER = 1e-3  # steps 3-6 under pp2 x dp2
STATE = 1e-6  # final amax histories and scales, relative to their largest value
FORWARD_ONLY = {"precision__fp8_high_precision": "dgrad,wgrad"}
MICROBATCH_GAP = 1e-4  # "microbatch" under DualPipe: worst relative gap, at least this


@pytest.fixture(scope="module")
def runs(tiny_job_args, jobs_train, tmp_path_factory) -> Path:
    """Every run: one-process references, then the pp = 2 cases in one launch."""
    out = tmp_path_factory.mktemp("fp8_delayed_dualpipe")
    job = tiny_job_args(out / "unused", **JOB)
    one = [
        ("one_step", override_args(train__grad_accum=4, **STEP)),
        ("one_microbatch", override_args(train__grad_accum=4)),
    ]
    pp = []
    for kind in ("dualpipe", "dualpipev"):
        pp.append((f"{kind}_step", override_args(parallel__pp_schedule=kind, **PP2, **STEP)))
    pp.append(("dualpipe_microbatch", override_args(parallel__pp_schedule="dualpipe", **PP2)))
    stopped = override_args(parallel__pp_schedule="dualpipev", **PP2, **STEP)
    pp.append(("dualpipev_stopped", [*stopped, "--train.stop_at_step", "3"]))
    pp.append(("dualpipev_stopped", stopped))  # resumes the run above
    for nproc, cases in ((1, one), (2, pp)):
        result = jobs_train(out, nproc, job, cases)
        assert result.returncode == 0, result.stderr[-3000:]
    return out


def worst_gaps(ref: list[dict], got: list[dict]) -> list[float]:
    """Per step, the larger relative difference of loss and gradient norm."""
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    return [
        max(abs(a[k] - b[k]) / abs(a[k]) for k in ("loss", "grad_norm"))
        for a, b in zip(ref, got, strict=True)
    ]


def assert_equal_to_one_process(ref_dir: Path, got_dir: Path, after: float) -> None:
    gaps = worst_gaps(read_metrics(ref_dir), read_metrics(got_dir))
    bounds = [EQUAL_FIRST] * 2 + [after] * (STEPS - 2)
    assert all(g <= b for g, b in zip(gaps, bounds, strict=True)), gaps


@pytest.mark.parametrize("kind", ["dualpipe", "dualpipev"])
def test_delayed_step_under_dualpipe_equals_one_process(runs, kind):
    assert_equal_to_one_process(runs / "one_step", runs / f"{kind}_step", EQUAL_AFTER)
    # The final scaling state, gathered over pp: one process's (to the weights' drift).
    want, got = fp8_state(runs / "one_step"), fp8_state(runs / f"{kind}_step")
    assert want and sorted(got) == sorted(want)
    for key, value in want.items():
        gap = ((got[key] - value).abs().max() / value.abs().max()).item()
        assert gap <= STATE, (key, gap)
        if key.endswith("fp8_amax_history"):  # the trainer rolled once per step, not per
            assert int(value.ne(0).any(-1).sum()) == STEPS, key  # micro-batch (4 x STEPS)
        else:  # and the scales moved
            assert value.ne(1).all(), key


def test_delayed_microbatch_under_dualpipe_is_not_one_process(runs):
    """The default keeps its old behaviour: each copy's scales move with its own
    micro-batches, measurably away from one process's."""
    gaps = worst_gaps(
        read_metrics(runs / "one_microbatch"), read_metrics(runs / "dualpipe_microbatch")
    )
    assert max(gaps) >= MICROBATCH_GAP, gaps


def test_delayed_step_under_dualpipev_resumes_bitwise(runs):
    assert_fp8_resumes(runs / "dualpipev_step", runs / "dualpipev_stopped", 3)


@pytest.mark.slow
def test_delayed_step_pp2_dp2_dualpipe_equals_one_process(tiny_job_args, jobs_train, tmp_path):
    """Four processes: two dp replicas of a DualPipe pp = 2 pipeline, whose state is reduced
    over the copies and over dp before the step's one update. Forward GEMMs in FP8 only: a
    dp rank's output gradients are twice one process's (its loss is the mean of half the
    rows), which the first step quantizes at the initial unit scale, where a factor of two
    changes E5M2 underflow (as in test_fp8_data_parallel.py); later scales absorb it."""
    job = tiny_job_args(tmp_path / "unused", **JOB, **STEP, **FORWARD_ONLY)
    one = [("one", override_args(train__grad_accum=8))]
    pp_dp = override_args(parallel__pp_schedule="dualpipe", parallel__dp=2, **PP2)
    for nproc, cases in ((1, one), (4, [("pp2_dp2", pp_dp)])):
        result = jobs_train(tmp_path, nproc, job, cases)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_equal_to_one_process(tmp_path / "one", tmp_path / "pp2_dp2", DP_AFTER)
