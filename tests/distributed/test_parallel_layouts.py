"""Parallel layouts train exactly like one process (gloo workers on CPU).

Each layout trains 5 steps with the same global batch as the single-process reference; losses
and gradient norms must agree to a relative 1e-5 (fp32). Worlds 2 and 4 run every layout,
world 8 six of its fifteen (`WORLD8`), each world in one torchrun launch of
`jobs_worker.py`, the CLI's Trainer and config loading
without an interpreter start-up per layout; the other tests here go through
`hyperloom train --nproc N` itself.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import override_args

from hyperloom import checkpoint as ckpt

STEPS = 5
GLOBAL_BATCH = 8
# Divisible by tp = 4 everywhere it must be: heads, kv heads, ffn, vocab, sequence.
MODEL = {
    "model__dim": 64,
    "model__n_heads": 8,
    "model__n_kv_heads": 4,
    "model__ffn_dim": 128,
    "data__seq_len": 32,
    "train__steps": STEPS,
    "train__warmup_steps": 2,
    "train__eval_batches": 2,
}


def layouts(world: int) -> list[tuple[int, int, bool, int]]:
    """(tp, dp, sp, zero) for every valid combination at this world size."""
    out = []
    for tp in (1, 2, 4):
        if world % tp:
            continue
        dp = world // tp
        for sp in (False, True) if tp > 1 else (False,):
            for zero in (0, 1, 3) if dp > 1 else (0,):
                out.append((tp, dp, sp, zero))
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "train"]


def run(tiny_job_args, run_dir: Path, nproc: int, **overrides) -> subprocess.CompletedProcess:
    args = ["train", "--nproc", str(nproc), *tiny_job_args(run_dir, **{**MODEL, **overrides})]
    return subprocess.run(
        [sys.executable, "-m", "hyperloom", *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def reference(tiny_job_args, tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("reference")
    result = run(tiny_job_args, run_dir, 1, train__micro_batch_size=GLOBAL_BATCH)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir)


def assert_same_training(reference: list[dict], other: list[dict], steps=None) -> None:
    ref = {r["step"]: r for r in reference}
    steps = steps or sorted(ref)
    got = {r["step"]: r for r in other}
    assert sorted(got) == sorted(steps)
    for step in steps:
        for key in ("loss", "grad_norm"):
            a, b = ref[step][key], got[step][key]
            assert abs(a - b) <= 1e-5 * abs(a), f"step {step} {key}: {a} vs {b}"


# World 8 runs 6 of its 15 layouts: tp 4 x dp 2, which world 4 cannot have, with each sp and
# zero once, tp 2 x dp 4 twice and dp 8 with FSDP (world 4 runs all 11 of its layouts; the 15
# took 61 s of the suite under load).
WORLD8 = [(1, 8, False, 3), (2, 4, True, 1), (2, 4, False, 3), (4, 2, False, 1), (4, 2, True, 0)]
WORLD8 += [(4, 2, True, 3)]


def layouts_to_run(world: int) -> list[tuple[int, int, bool, int]]:
    if world != 8:
        return layouts(world)
    assert set(WORLD8) <= set(layouts(8))
    return WORLD8


def _case(world: int, layout: tuple[int, int, bool, int]):
    tp, dp, sp, zero = layout
    marks = [pytest.mark.slow] if world == 8 else []
    return pytest.param(
        world, *layout, id=f"w{world}-tp{tp}-dp{dp}-sp{int(sp)}-zero{zero}", marks=marks
    )


def _check_run(reference: list[dict], run_dir: Path, world: int) -> None:
    assert_same_training(reference, read_metrics(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"].endswith(f"= {world}")


def test_qk_norm_under_tensor_and_sequence_parallel_equals_single_process(tiny_job_args, tmp_path):
    """model.qk_norm at tp = 2 with sp: each rank normalises only its own heads, so the q/k
    norm weights' gradients are partial sums the plan adds over tp ("tp_partial_grad").
    Without that sum, Adam's scale invariance hides most of it from the loss (the gradient norm
    of step 2 moved by 2e-5 relative), but after 5 steps the norm weights are 1% off."""
    ref = run(
        tiny_job_args,
        tmp_path / "ref",
        1,
        train__micro_batch_size=GLOBAL_BATCH,
        model__qk_norm=True,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    tp = run(
        tiny_job_args,
        tmp_path / "tp",
        2,
        parallel__tp=2,
        parallel__sp=True,
        train__micro_batch_size=GLOBAL_BATCH,
        model__qk_norm=True,
    )
    assert tp.returncode == 0, tp.stderr[-3000:]
    ref_w, tp_w = (
        ckpt.load_model_state(ckpt.resolve_checkpoint(tmp_path / r)) for r in ("ref", "tp")
    )
    norms = [n for n in ref_w if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * 2  # two layers
    for name in norms:
        assert not torch.equal(ref_w[name], torch.ones_like(ref_w[name])), name  # trained
        named = lambda m, name=name: f"{name}: {m}"  # noqa: E731
        torch.testing.assert_close(tp_w[name], ref_w[name], rtol=1e-5, atol=1e-6, msg=named)
    _check_run(read_metrics(tmp_path / "ref"), tmp_path / "tp", 2)


@pytest.fixture(scope="module")
def many_layouts(tiny_job_args, jobs_train, tmp_path_factory):
    """The layouts of worlds 2, 4 and 8, one torchrun launch per world (`jobs_worker.py`):
    the same Trainer as the CLI, without paying interpreter and torch start-up per layout."""
    out = tmp_path_factory.mktemp("layouts")
    job = tiny_job_args(out / "unused", **MODEL)
    launched: dict[int, subprocess.CompletedProcess] = {}

    def launch(world: int) -> tuple[Path, subprocess.CompletedProcess]:
        if world not in launched:
            cases = [
                (
                    f"{tp}-{dp}-{int(sp)}-{zero}",
                    override_args(
                        parallel__tp=tp,
                        parallel__dp=dp,
                        parallel__sp=sp,
                        parallel__zero=zero,
                        train__micro_batch_size=GLOBAL_BATCH // dp,
                    ),
                )
                for tp, dp, sp, zero in layouts_to_run(world)
            ]
            launched[world] = jobs_train(out / f"w{world}", world, job, cases)
        return out / f"w{world}", launched[world]

    return launch


@pytest.mark.parametrize(
    "world,tp,dp,sp,zero", [_case(w, lay) for w in (2, 4, 8) for lay in layouts_to_run(w)]
)
def test_many_layouts_equal_single_process(reference, many_layouts, world, tp, dp, sp, zero):
    out, result = many_layouts(world)
    assert result.returncode == 0, result.stderr[-3000:]
    _check_run(reference, out / f"{tp}-{dp}-{int(sp)}-{zero}", world)


def test_checkpoint_moves_between_layouts(reference, tiny_job_args, tmp_path):
    """Saved at tp=2 x dp=2, resumed at tp=1 x dp=4 and in one process: the remaining
    steps reproduce the uninterrupted run."""
    first = tmp_path / "tp2dp2"
    result = run(
        tiny_job_args,
        first,
        4,
        parallel__tp=2,
        parallel__dp=2,
        train__micro_batch_size=GLOBAL_BATCH // 2,
        train__stop_at_step=3,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (first / "checkpoints" / "step_00000003").is_dir()
    for name, nproc, extra in (
        (
            "dp4",
            4,
            {"parallel__dp": 4, "parallel__zero": 3, "train__micro_batch_size": GLOBAL_BATCH // 4},
        ),
        ("single", 1, {"train__micro_batch_size": GLOBAL_BATCH}),
    ):
        resumed = tmp_path / name
        shutil.copytree(first, resumed)
        result = run(tiny_job_args, resumed, nproc, **extra)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "resumed from" in result.stderr
        assert_same_training(reference, read_metrics(resumed), steps=[1, 2, 3, 4, 5])


def test_checkpoint_resume_negative_control(reference, tiny_job_args, tmp_path):
    """Without the checkpoint (a fresh start of the last two steps' config) the losses of
    steps 4-5 do not match: the test above can fail."""
    result = run(
        tiny_job_args,
        tmp_path,
        2,
        parallel__dp=2,
        train__micro_batch_size=GLOBAL_BATCH // 2,
        checkpoint__resume="none",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path)}
    ref = {r["step"]: r["loss"] for r in reference}
    assert got[1] == pytest.approx(ref[1], rel=1e-5)  # same start...
    shifted = [r["loss"] for r in reference][:2]
    assert [got[4], got[5]] != pytest.approx(shifted, rel=1e-5)


@pytest.mark.parametrize(
    "tp,dp,zero", [(2, 1, 0), (1, 2, 0), (1, 2, 1), (2, 2, 1), (1, 2, 3), (2, 2, 3)]
)
def test_state_bytes_follow_the_layout(tiny_job_args, tmp_path, tp, dp, zero):
    """Parameters, gradients and Adam moments per rank: tensor-parallel weights are 1/tp;
    zero = 1 divides the master weights and moments by dp, zero = 3 everything; under
    zero = 0 dp replicates."""
    worker = Path(__file__).with_name("state_bytes_worker.py")
    args = tiny_job_args(
        tmp_path,
        **MODEL,
        parallel__tp=tp,
        parallel__dp=dp,
        parallel__zero=zero,
        train__micro_batch_size=GLOBAL_BATCH // dp,
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={tp * dp}",
            str(worker),
            str(tmp_path),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    from hyperloom.config import load_config
    from hyperloom.models.registry import build_model

    model = build_model(load_config(None, tiny_job_args(tmp_path, **MODEL)).model)
    sharded = sum(p.numel() for n, p in model.named_parameters() if not n.endswith("norm.weight"))
    replicated = sum(p.numel() for n, p in model.named_parameters() if n.endswith("norm.weight"))
    per_rank = sharded / tp + replicated
    state = per_rank / dp if zero in (1, 3) else per_rank  # master weights, each moment
    if zero == 3:
        per_rank /= dp
    for rank in range(tp * dp):
        stats = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert stats["params"] == pytest.approx(4 * per_rank, abs=4 * dp)  # fp32
        assert stats["grads"] == stats["params"]
        # ZeRO-1 pads the flat space to a multiple of dp: at most dp - 1 extra elements.
        assert stats["master"] == pytest.approx(4 * state, abs=4 * dp)
        assert stats["optimizer"] == pytest.approx(2 * 4 * state, abs=8 * dp)


def test_invalid_layout_fails_once_with_the_arithmetic(tiny_job_args, tmp_path):
    result = run(tiny_job_args, tmp_path, 2, parallel__tp=4)
    assert result.returncode == 2
    assert "dp(1) * tp(4) * pp(1) * cp(1) = 4 != world size 2" in result.stderr
    assert "Traceback" not in result.stderr


def test_invalid_layout_under_torchrun_reports_every_rank(tiny_job_args, tmp_path):
    """Straight through torchrun (no launcher-side check): every rank names itself, exits,
    and nothing hangs."""
    args = tiny_job_args(tmp_path, **{**MODEL, "parallel__tp": 2, "model__n_kv_heads": 1})
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            # torchrun stops the other ranks once one has failed; on a loaded machine one
            # rank may reach its error a tenth of a second after the other
            "--monitor-interval=5",
            "-m",
            "hyperloom",
            "train",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"(rank {rank}): error" in result.stderr
    assert "model.n_kv_heads (1) is not divisible by parallel.tp (2)" in result.stderr
