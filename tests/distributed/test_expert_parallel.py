"""Expert parallelism equals one process: losses, gradient norms and every gradient over 5
steps at dp = 4 with ep = 1, 2, 4 and both dispatchers (`expert_parallel_worker.py`, one
torchrun launch), and `hyperloom train` of the MoE preset with ep = 2 reproduces the
one-process losses, under DDP, ZeRO-1 (also with pp) and FSDP2, whose checkpoints resume in
other layouts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import override_args, run_workers

from hyperloom import checkpoint as ckpt

TOL = 1e-5  # fp32; the experts see the same rows in a different order and grouping
LATER_STEPS_TOL = 5e-4  # steps 3-5 of the layouts against one process (assert_same_training)
# The weights after five Adam steps: its normalised update m / sqrt(v) turns the ~1e-7
# summation-order differences of tiny gradients (embedding rows of rare tokens) into whole
# update-sized ones; measured 2.7e-5 relative for tok_embeddings on an Intel Xeon.
WEIGHTS_TOL = 1e-4


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ep") / "report.json"
    worker = Path(__file__).with_name("expert_parallel_worker.py")
    run_workers(worker, 4, out, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "layout",
    ["ep1-alltoall", "ep2-alltoall", "ep4-alltoall", "ep2-allgather", "ep4-allgather"]
    + ["ep2-zero1", "ep4-zero1", "ep2-zero3", "ep4-zero3", "tp2-ep2-zero1", "tp2-ep2-zero3"],
)
def test_expert_parallel_equals_one_process(report, layout):
    """ZeRO-1 and FSDP2 shard the experts over their replicas (dp / ep ranks): the gradients
    (FSDP2's), the gradient norm (each expert counted once) and the weights after five
    steps are one process's; the routing biases stay whole."""
    r = report[layout]
    ep = int(layout.partition("ep")[2][0])
    assert r["local_experts"] == 8 // ep  # each rank really holds E / ep experts
    assert r["same_names"]
    for key in ("loss", "norm", "grad"):
        if r[key] is None:  # ZeRO-1 keeps the reduced gradients in its flat shards
            continue
        worst = f" ({r['worst']})" if key == "grad" else ""
        assert r[key] <= TOL, f"{layout}: {key} differs by {r[key]:.2e} (relative){worst}"
    assert r["weights"] <= WEIGHTS_TOL, f"{layout}: weights differ by {r['weights']:.2e}"
    if layout.endswith("zero3"):  # FSDP2 splits an ep rank's experts over its dp / ep replicas
        dp = 4 // int(layout[2]) if layout.startswith("tp") else 4
        held = 8 // dp if dp > ep else None  # None: left whole (no replicas to shard over)
        assert r["held_experts"] == held and r["bias_whole"], r
    assert r["zero1_sharded"] is (True if layout.endswith("zero1") else None)
    # The reference trained: it is a real comparison, not of two untrained models.
    assert report["reference_loss"][-1] < report["reference_loss"][0]


# The moe-tiny preset's own shape (MLA, 16 experts top-2 in 4 groups, a shared expert, one
# MTP module, aux-loss-free balancing) with the tiny job's vocabulary and sequence length.
MOE_TINY = {
    "model__preset": "moe-tiny",
    "model__dim": 256,
    "model__n_layers": 4,
    "model__n_heads": 4,
    "model__n_kv_heads": 4,
    "model__ffn_dim": 768,
    "train__steps": 5,
    "train__warmup_steps": 2,
    "checkpoint__every": 5,
}


def assert_same_training(one: list[dict], other: list[dict]) -> None:
    """Per-step loss and gradient norm of a layout against one process.

    Tolerance: 1e-5 for the first two steps, where a missing loss term or a wrong bias update
    shows (each gave >= 1.4e-4 while being fixed), then LATER_STEPS_TOL: a layout changes the
    float summation order (micro-batch accumulation, tensor-parallel partial sums), and the
    routers' top-k and Adam's normalised updates amplify that by steps 3-5 to a measured
    2e-5 - 6e-5 on an AMD EPYC and up to 2.1e-4 on an Intel Xeon (pp2 x dp2 x ep2 DualPipe's
    step-4 gradient norm), whose GEMMs sum in a different order.
    """
    assert [r["step"] for r in one] == [r["step"] for r in other]
    for a, b in zip(one, other, strict=True):
        tol = TOL if a["step"] <= 2 else LATER_STEPS_TOL
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= tol * abs(a[key]), (a["step"], key, a[key], b[key])


def _train(tiny_job_args, run_dir: Path, nproc: int, **overrides) -> list[dict]:
    args = ["train", "--nproc", str(nproc), *tiny_job_args(run_dir, **{**MOE_TINY, **overrides})]
    result = subprocess.run(
        [sys.executable, "-m", "hyperloom", *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "train"]


def test_moe_tiny_trains_with_ep2_like_one_process(tiny_job_args, tmp_path):
    from safetensors.torch import load_file

    one = _train(tiny_job_args, tmp_path / "one", 1, train__micro_batch_size=4)
    two = _train(
        tiny_job_args,
        tmp_path / "ep2",
        2,
        train__micro_batch_size=2,
        parallel__dp=2,
        parallel__ep=2,
    )
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4, 5]
    # each step's expert all-to-all time, and the part of it the rank waited for
    assert all(0 < r["a2a_exposed_s"] <= r["a2a_in_flight_s"] for r in two)
    assert "a2a_exposed_s" not in one[0]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= TOL * abs(a[key]), (a["step"], key, a[key], b[key])
    # The checkpoint gathers each rank's experts back into whole (E, out, in) tensors.
    weights = [
        load_file(next((tmp_path / d / "checkpoints").glob("step_*")) / "model.safetensors")
        for d in ("one", "ep2")
    ]
    assert weights[0].keys() == weights[1].keys()
    for name, a in weights[0].items():
        b = weights[1][name]
        assert a.shape == b.shape, name
        assert (a - b).norm() <= WEIGHTS_TOL * a.norm().clamp(min=1e-12), name


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, {"parallel__pp": 2, "train__micro_batch_size": 2}),  # MTP and a head on stage 1
        (
            4,  # pipeline x expert x data parallel, DualPipe's two directions
            {
                "parallel__pp": 2,
                "parallel__dp": 2,
                "parallel__ep": 2,
                "parallel__pp_schedule": "dualpipe",
                "parallel__microbatches": 4,  # DualPipe needs 2 x pp
                "train__micro_batch_size": 1,
            },
        ),
    ],
    ids=["pp2", "pp2-dp2-ep2-dualpipe"],
)
def test_moe_pipeline_trains_like_one_process(tiny_job_args, tmp_path, nproc, layout):
    """Balance losses of the first stage join the loss through the executor's side loss; the
    MTP module on the last stage reads the embedding copy and the labels; DualPipe's layer
    copies move their routing biases by the summed load.
    """
    rows = layout["train__micro_batch_size"] * layout.get("parallel__microbatches", 2)
    rows *= layout.get("parallel__dp", 1)
    one = _train(tiny_job_args, tmp_path / "one", 1, train__micro_batch_size=rows)
    pp = _train(tiny_job_args, tmp_path / "pp", nproc, **{"parallel__microbatches": 2, **layout})
    assert_same_training(one, pp)
    assert set(pp[-1]["expert_load"]) == set(one[-1]["expert_load"])  # every stage's layers


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, {"parallel__tp": 2, "train__micro_batch_size": 4}),
        (
            4,
            {"parallel__tp": 2, "parallel__dp": 2, "parallel__ep": 2, "train__micro_batch_size": 2},
        ),
    ],
    ids=["tp2", "tp2-dp2-ep2"],
)
def test_moe_tensor_parallel_trains_like_one_process(tiny_job_args, tmp_path, nproc, layout):
    """MLA split by heads (the low-rank projections' output gradients summed over tp before
    their backward), the dense layers and shared experts split like Llama's SwiGLU, the
    vocab-parallel head for the main and the MTP loss, the routed experts replicated over tp
    (and split over ep). FP8 with tp is checked in test_fp8_tensor_parallel.py."""
    one = _train(tiny_job_args, tmp_path / "one", 1, train__micro_batch_size=4)
    tp = _train(tiny_job_args, tmp_path / "tp", nproc, **layout)
    assert_same_training(one, tp)


# ZeRO-1 and FSDP2 with ep at dp4 x ep2 (and ZeRO-1 under pp), each saving at step 3 (FSDP2
# in the sharded format): one torchrun launch of 4 ranks (`jobs_worker.py`), in which FSDP2
# at ep4 (dp x cp = ep: the experts stay whole) resumes the ZeRO-1 run; one process then
# trains the reference and resumes both dp4 x ep2 checkpoints.
SHARDED_EP = {
    "dp4-ep2-zero1": {"parallel__dp": 4, "parallel__ep": 2, "parallel__zero": 1},
    "dp4-ep2-zero3": {
        "parallel__dp": 4,
        "parallel__ep": 2,
        "parallel__zero": 3,
        "checkpoint__format": "sharded",
    },
    "pp2-dp2-ep2-zero1": {
        "parallel__pp": 2,
        "parallel__dp": 2,
        "parallel__ep": 2,
        "parallel__zero": 1,
        "parallel__microbatches": 2,
    },
}
RESUMED = {  # name: (the run whose step-3 checkpoint it resumes, its layout, ranks)
    "dp4-ep4-zero3-from-zero1": (
        "dp4-ep2-zero1",
        {"parallel__dp": 4, "parallel__ep": 4, "parallel__zero": 3},
        4,
    ),
    "one-from-zero1": ("dp4-ep2-zero1", {"train__micro_batch_size": 4}, 1),
    "one-from-zero3": ("dp4-ep2-zero3", {"train__micro_batch_size": 4}, 1),
}


@pytest.fixture(scope="module")
def sharded_ep(tiny_job_args, jobs_train, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ep-sharded")
    job = tiny_job_args(out / "unused", **{**MOE_TINY, "checkpoint__every": 3})
    cases: dict[int, list] = {4: [], 1: [("one", override_args(train__micro_batch_size=4))]}
    for name, layout in SHARDED_EP.items():
        cases[4].append((name, override_args(train__micro_batch_size=1, **layout)))
    for name, (source, layout, world) in RESUMED.items():
        resume = ckpt.checkpoint_dir(out / f"w4/{source}", 3)
        over = override_args(**{"train__micro_batch_size": 1, **layout}, checkpoint__resume=resume)
        cases[world].append((name, over))
    for world in (4, 1):  # the resumed runs read the world-4 checkpoints
        result = jobs_train(out / f"w{world}", world, job, cases[world])
        assert result.returncode == 0, result.stderr[-3000:]
    return out


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "train"]


@pytest.mark.parametrize("name", sorted(SHARDED_EP))
def test_sharded_data_parallel_with_ep_trains_like_one_process(sharded_ep, name):
    """ZeRO-1 shards the experts' state over their replicas (dp / ep ranks) and the rest over
    dp; FSDP2 shards the expert banks over those replicas and keeps the routing biases whole.
    Both reduce the experts' gradients to the one-process ones and count every expert once
    in the gradient norm (1e-5 for steps 1-2)."""
    one = _records(sharded_ep / "w1" / "one")
    assert_same_training(one, _records(sharded_ep / "w4" / name))


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_sharded_ep_checkpoint_resumes_in_other_layouts(sharded_ep, name):
    """Steps 4-5 resumed from a dp4 x ep2 ZeRO-1 checkpoint (whole tensors by global name) or
    an FSDP2 one (sharded: DCP reshards) in one process or at another ep go on as the
    uninterrupted one-process run (dropping the Adam moments moves step 5's loss by 2e-3)."""
    source, _, world = RESUMED[name]
    one = _records(sharded_ep / "w1" / "one")
    resumed = _records(sharded_ep / f"w{world}" / name)
    assert [r["step"] for r in resumed] == [4, 5]
    assert_same_training(one[3:], resumed)
