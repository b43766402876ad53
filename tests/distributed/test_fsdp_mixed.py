"""FSDP2's mixed precision and HSDP train like one process and move the bytes they should
(gloo workers on CPU, the tiny model of `test_parallel_layouts`).

**BF16 gathers** (`parallel.fsdp_param_dtype = bf16`) run each block on BF16 weights and BF16
inputs, residual stream included, where one process under autocast keeps the residual FP32
and casts per op. The fair one-process reference is that BF16 run (`precision.dtype = bf16`,
FP32 master weights): the same BF16 GEMMs on the same weights. Two things separate them:
module-level against per-op casts, and the batch split (each rank rounds its share of the
weight gradient to BF16, one process the whole batch's). Measured over 5 steps (dp 2, HSDP
2 x 2 and tp 2 x dp 2; FP32 or BF16 reduction), relative to that run:

- step 1, the same weights: losses within 5e-6, gradient norms within 8e-5 (one process in
  FP32 lies 2.2e-4 from one in BF16);
- steps 2-5: losses within 5.2e-5, gradient norms within 4.3e-3: Adam moves a weight by about
  the learning rate whatever the size of its gradient, so BF16 rounding that flips a tiny
  gradient's sign moves the weight, and the next gradients, visibly;
- final weights 2.9-3.2e-3 apart in relative norm, as far as one process in FP32 lies from one
  in BF16 (2.6e-3).

The bounds (`BOUNDS`) round those up: losses 1e-4, gradient norms 2e-4 at step 1 and 1e-2
after, weights 5e-3; a wrong reduction (a factor of dp, replicas left apart) misses them by
far. FP8 (current scaling; its reference accumulates the ranks' micro-batches, as FP8 scales
each one) quantizes BF16 weights instead of FP32 ones: 4.1e-4 at step 1, 9.8e-3 at step 5,
weights 1.2e-2 (one FP8 process with its batch split otherwise lands 1.4e-2 away). A MoE
(ep 2 x dp 4, the experts sharded over their replicas in BF16) routes some tokens elsewhere
once BF16 moves its router's logits: gradient norms 1.0e-2, weights 3.4e-2 (FP32 gathers
under the same autocast: 2.5e-3, 1.2e-2). Which dtype each piece has is checked directly: the
gathers' bytes (half of FP32's) and the FP32 master weights (after training almost none is a
BF16 value; all would be if the masters were BF16).

**HSDP** (`parallel.dp_replicate`) changes only where the sums run, so in FP32 it is held to
the layouts' usual 1e-5 (`test_parallel_layouts`), and its checkpoints, whole and sharded,
resume bit for bit (whole: in one process too, to 1e-5).

The bytes come from `benchmarks/fsdp_bytes.py`'s counter around each training step; they must
equal its formulas exactly, and the planner's where it costs the layout.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import override_args
from test_parallel_layouts import GLOBAL_BATCH, MODEL, assert_same_training, read_metrics

from hyperloom import checkpoint as ckpt
from hyperloom.config import ConfigError, load_config
from hyperloom.planner.strategy import Strategy

BENCHMARK = "fsdp_bytes"
STEPS = MODEL["train__steps"]
BF16 = {"precision__dtype": "bf16"}
Z3 = {"parallel__zero": 3}
DP4 = {**Z3, "parallel__dp": 4, "train__micro_batch_size": GLOBAL_BATCH // 4}
HSDP = {**DP4, "parallel__dp_replicate": 2}
GATHER16 = {"parallel__fsdp_param_dtype": "bf16"}
SHARDED = {"checkpoint__format": "sharded"}
FP8 = {"precision__fp8": "current"}
MOE = {  # the DeepSeek family's tiny MoE: 2 layers, the second routed
    "model__preset": "moe-tiny",
    "model__n_heads": 4,
    "model__n_kv_heads": 4,
    "model__n_layers": 2,
}
# relative bounds on (loss, step-1 gradient norm, later gradient norms, final weights): the
# module docstring says why
BOUNDS = (1e-4, 2e-4, 1e-2, 5e-3)
FP8_BOUNDS = (5e-4, 1e-3, 2e-2, 3e-2)
MOE_BOUNDS = (1e-4, 2e-4, 2e-2, 6e-2)


STOP = {"train__stop_at_step": 3}
DP2 = {**Z3, **BF16, **GATHER16, "parallel__dp": 2}
# The runs, in launches of (processes, [(run, overrides)]): each launch pays torch's start-up
# once for its runs (`jobs_worker.py`); a run of one name twice is a run and its resumption.
LAUNCHES = {
    "one": (
        1,
        [
            ("ref", {"train__micro_batch_size": GLOBAL_BATCH}),
            ("ref_bf16", {**BF16, "train__micro_batch_size": GLOBAL_BATCH}),
            # FP8's current scaling scales each micro-batch: accumulate the dp ranks' ones
            ("ref_fp8", {**BF16, **FP8, "train__grad_accum": 2}),
            ("ref_moe", {**BF16, **MOE, "train__micro_batch_size": GLOBAL_BATCH}),
        ],
    ),
    "world2": (
        2,
        [
            ("dp2_bf16", DP2),
            ("dp2_bf16_reduce", {**DP2, "parallel__fsdp_reduce_dtype": "bf16"}),
            ("dp2_fp8", {**DP2, **FP8}),
        ],
    ),
    "world4": (
        4,
        [
            ("hsdp", HSDP),
            (
                "hsdp_cp2",
                {**HSDP, "parallel__dp": 2, "parallel__cp": 2, "train__micro_batch_size": 4},
            ),
            ("hsdp_bf16", {**HSDP, **BF16, **GATHER16}),
            ("tp2_bf16", {**Z3, **BF16, **GATHER16, "parallel__tp": 2, "parallel__dp": 2}),
            ("ep2_bf16", {**DP4, **BF16, **GATHER16, **MOE, "parallel__ep": 2}),
        ],
    ),
    "stopped": (
        4,
        [
            ("hsdp_whole", {**HSDP, **STOP}),
            ("hsdp_sharded", {**HSDP, **SHARDED, **STOP}),
            ("hsdp_sharded", {**HSDP, **SHARDED}),  # resumes the run above
        ],
    ),
}


@pytest.fixture(scope="module")
def runs(tiny_job_args, jobs_train, tmp_path_factory):
    """runs(*names): the folder holding the named runs, each launch of `LAUNCHES` that has one
    of them run once (per module)."""
    out = tmp_path_factory.mktemp("fsdp_mixed")
    job = tiny_job_args(out / "unused", **MODEL, train__micro_batch_size=GLOBAL_BATCH // 2)
    done: set[str] = set()

    def need(*names: str) -> Path:
        for key, (nproc, cases) in LAUNCHES.items():
            if key in done or not {n for n, _ in cases} & set(names):
                continue
            result = jobs_train(out, nproc, job, [(n, override_args(**o)) for n, o in cases])
            assert result.returncode == 0, result.stderr[-3000:]
            done.add(key)
        return out

    need.job = job
    return need


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_model_state(ckpt.resolve_checkpoint(run_dir))


def _relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = sum(((a[k] - b[k]).double() ** 2).sum() for k in a)
    return float((diff / sum((b[k].double() ** 2).sum() for k in b)).sqrt())


def _bf16_exact_share(state: dict[str, torch.Tensor]) -> float:
    """The share of the trained weights that are BF16 values (FP32 masters: almost none)."""
    flat = torch.cat([t.flatten() for t in state.values()])
    return float((flat.bfloat16().float() == flat).double().mean())


@pytest.mark.parametrize(
    ("name", "reference", "bounds"),
    [
        ("dp2_bf16", "ref_bf16", BOUNDS),
        ("dp2_bf16_reduce", "ref_bf16", BOUNDS),
        ("hsdp_bf16", "ref_bf16", BOUNDS),
        ("tp2_bf16", "ref_bf16", BOUNDS),
        ("dp2_fp8", "ref_fp8", FP8_BOUNDS),
        ("ep2_bf16", "ref_moe", MOE_BOUNDS),
    ],
)
def test_bf16_gathers_equal_one_process(runs, name, reference, bounds):
    """BF16 gathers, with FP32 or BF16 reduction, under plain FSDP2, HSDP, tp x FSDP2, FP8
    and ep: the one-process run in the same precision within the module docstring's bounds
    (loss, gradient norm, weights), and FP32 master weights."""
    loss_rel, first_norm_rel, norm_rel, weight_rel = bounds
    out = runs(name, reference)
    ref, got = read_metrics(out / reference), read_metrics(out / name)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got, strict=True):
        bound = first_norm_rel if a["step"] == 1 else norm_rel
        assert b["loss"] == pytest.approx(a["loss"], rel=loss_rel), (a["step"], "loss")
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=bound), (a["step"], "norm")
    mine, one = _weights(out / name), _weights(out / reference)
    assert all(t.dtype == torch.float32 for t in mine.values())
    assert _relative_distance(mine, one) <= weight_rel
    assert _bf16_exact_share(mine) < 0.01


@pytest.mark.parametrize("name", ["hsdp", "hsdp_cp2"])
def test_hsdp_equals_one_process_in_fp32(runs, name):
    """HSDP in FP32, two replicas over dp 4 and over dp 2 x cp 2 (each replica shards over
    its two context ranks): the layouts' 1e-5, and the same weights to FP32 rounding."""
    out = runs("ref", name)
    assert_same_training(read_metrics(out / "ref"), read_metrics(out / name))
    assert _relative_distance(_weights(out / name), _weights(out / "ref")) <= 1e-5


def test_hsdp_checkpoints_resume(runs, jobs_train):
    """Stopped at step 3 and resumed: the sharded format under HSDP takes steps 4-5 bit for
    bit like the run that went on; the whole format resumes in one process to 1e-5."""
    out = runs("ref", "hsdp", "hsdp_sharded")
    whole = {r["step"]: r for r in read_metrics(out / "hsdp")}
    resumed = read_metrics(out / "hsdp_sharded")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert ckpt.is_sharded(ckpt.resolve_checkpoint(out / "hsdp_sharded"))
    for r in resumed[3:]:
        assert (r["loss"], r["grad_norm"]) == (
            whole[r["step"]]["loss"],
            whole[r["step"]]["grad_norm"],
        )
    assert (out / "hsdp_whole" / "checkpoints" / "step_00000003").is_dir()
    shutil.copytree(out / "hsdp_whole", out / "one_from_hsdp")
    one = override_args(train__micro_batch_size=GLOBAL_BATCH)
    result = jobs_train(out, 1, runs.job, [("one_from_hsdp", one)])
    assert result.returncode == 0, result.stderr[-3000:]
    got = read_metrics(out / "one_from_hsdp")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]  # steps 1-3 are HSDP's, not run again
    assert_same_training(read_metrics(out / "ref"), got)


@pytest.fixture(scope="module")
def measured(bench, tmp_path_factory) -> dict:
    """Every layout of the benchmark at world 4, two steps, on the tests' tiny model."""
    a = argparse.Namespace(dim=64, layers=2, seq_len=32, batch=8, steps=2, dtype="bf16")
    return bench.measure(a, list(bench.LAYOUTS), tmp_path_factory.mktemp("fsdp_bytes"))


def test_bytes_moved_per_step(bench, measured):
    """Each layout's bytes per step and rank equal the formulas (both steps alike): BF16
    gathers move half the all-gather bytes, BF16 reduction half the reduce-scatter bytes;
    HSDP gathers and reduce-scatters the same buffers within its shard group of 2 and
    all-reduces the half-size shards across the replicas. The planner's match where it
    costs the layout."""
    got = measured["layouts"]
    for name, r in got.items():
        assert r["bytes"] == {**r["expected"], "other": r["bytes"]["other"]}, name
        assert r["per_step"][0] == r["per_step"][1], name
        # scalars: the gradient norm's float64 sum, the guard's health check
        assert r["bytes"]["other"] <= 64, name
        assert bench.planner_matches(r) is not False, name
    fp32, bf16 = got["fsdp dp4"]["bytes"], got["fsdp dp4 bf16-gather"]["bytes"]
    assert bf16["all_gather"] * 2 == fp32["all_gather"] > 0
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"] > 0
    assert (
        got["fsdp dp4 bf16-gather bf16-reduce"]["bytes"]["reduce_scatter"] * 2
        == fp32["reduce_scatter"]
    )
    hsdp = got["hsdp 2x2"]["bytes"]
    assert hsdp["all_reduce"] * 2 == hsdp["reduce_scatter"] == fp32["reduce_scatter"]
    assert fp32["all_reduce"] == 0
    assert got["hsdp 2x2 bf16-gather"]["bytes"]["all_gather"] == bf16["all_gather"]
    assert got["fsdp dp4"]["planner"] is not None and got["hsdp 2x2"]["planner"] is None
    for r in got.values():  # bf16 training, one process: the module docstring's loss bound
        assert r["max_rel_loss_diff"] <= BOUNDS[0]


def _problems(**overrides) -> str:
    args = override_args(**{**MODEL, **overrides})
    with pytest.raises(ConfigError) as info:
        load_config(None, args, world_size=4)
    return str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"parallel__dp": 4, "parallel__zero": 1, **GATHER16},
            "parallel.fsdp_param_dtype = 'bf16': FSDP2 settings, which need parallel.zero = 3 "
            "(got zero = 1)",
        ),
        (
            {"parallel__dp": 4, "parallel__dp_replicate": 2},
            "parallel.dp_replicate = 2: FSDP2 settings, which need parallel.zero = 3 "
            "(got zero = 0)",
        ),
        (
            {"parallel__dp": 4, **Z3, **GATHER16, "precision__dtype": "fp32"},
            "parallel.fsdp_param_dtype = 'bf16' computes with BF16 parameters, which "
            "precision.dtype = 'fp32' rules out",
        ),
        (
            {"parallel__dp": 4, **Z3, "parallel__dp_replicate": 3},
            "parallel.dp_replicate (3) does not divide parallel.dp (4)",
        ),
        (
            {"parallel__dp": 4, **Z3, "parallel__dp_replicate": 4},
            "parallel.dp_replicate (4) = dp x cp (4 x 1) leaves each replica one rank",
        ),
        (
            {"parallel__dp": 4, **Z3, "parallel__dp_replicate": 0},
            "parallel.dp_replicate must be >= 1, got 0",
        ),
        (
            {"parallel__dp": 4, **Z3, "parallel__dp_replicate": 2, "parallel__ep": 2},
            "parallel.dp_replicate = 2 with parallel.ep = 2 is not supported",
        ),
    ],
)
def test_config_refuses(overrides, message):
    assert re.search(re.escape(message), _problems(**overrides))


def test_planner_reads_the_hsdp_layout():
    """The planner plans this file's HSDP job (it refused HSDP once): two replica groups of
    two ranks each (`tests/unit/test_planner_memory_validation.py` checks its costs)."""
    job = load_config(None, override_args(**MODEL, **HSDP), world_size=4)
    s = Strategy.from_job(job)
    assert (s.zero, s.dp_replicate, s.fsdp_shard) == (3, 2, 2)
    assert "hsdp2" in s.label()
