"""Activation recompute under every parallel dimension, on 2 processes: tp2 with sequence
parallelism, dp2 with ZeRO-1, pp2 with 1F1B, ZB-V and DualPipe (split backward: the weight
gradients deferred past the recompute), dp2 x ep2 MoE (also with its routed experts
and MLA's up-projections recomputed), and FP8 delayed scaling under tp2.
Each policy trains bitwise like the same layout without recompute (fp32: the recomputed
forward runs the same kernels in the same order on the same data): every step's loss and
gradient norm, and the final weights. One launch trains every case (`jobs_worker.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

MOE = [
    *("--model.preset moe-tiny --model.dim 64 --model.n_layers 3 --model.n_heads 4".split()),
    *("--model.n_kv_heads 4 --model.ffn_dim 128 --model.moe_ffn_dim 32".split()),
    *("--model.vocab_size 512 --model.max_seq_len 64 --model.moe_bias_rate 1e-3".split()),
]
PP = "--train.micro_batch_size 1 --parallel.microbatches 4 --parallel.pp 2 --model.n_layers 4".split()

LAYOUTS = {
    "tp2sp": "--parallel.tp 2 --parallel.sp true".split(),
    "dp2z1": "--parallel.dp 2 --parallel.zero 1".split(),
    "pp2-1f1b": [*PP, "--parallel.pp_schedule", "1f1b"],
    "pp2-zbv": [*PP, "--parallel.pp_schedule", "zb-v"],
    "pp2-dualpipe": [*PP, "--parallel.pp_schedule", "dualpipe"],
    "dp2ep2-moe": [*MOE, *"--parallel.dp 2 --parallel.ep 2".split()],
    "tp2-fp8": "--parallel.tp 2 --precision.fp8 delayed".split()
    + "--precision.fp8_bf16_first_layers 0 --precision.fp8_bf16_last_layers 0".split(),
}
POLICIES = ["none", "full", "selective", "norm"]
# the routed experts' bank recomputed whole, its all-to-all dispatch run again in the backward
EXTRA = {"dp2ep2-moe": ["experts", "selective,experts,mla_up"]}


def policies(layout: str) -> list[str]:
    skip = {"norm"} if layout == "tp2-fp8" else set()
    return [p for p in POLICIES + EXTRA.get(layout, []) if p not in skip]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_job_args, jobs_train) -> Path:
    out = tmp_path_factory.mktemp("recompute")
    job = tiny_job_args(out / "unused", train__steps=4, checkpoint__every=0)
    cases = [
        (f"{layout}-{policy}", [*args, "--train.recompute", policy])
        for layout, args in LAYOUTS.items()
        for policy in policies(layout)
    ]
    result = jobs_train(out, 2, job, cases)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def steps(run: Path) -> list[tuple[float, float]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [(r["loss"], r["grad_norm"]) for r in records if r.get("event") == "train"]


def weights(run: Path) -> dict:
    (final,) = sorted((run / "checkpoints").glob("step_*"))[-1:]
    return load_file(final / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_recompute_trains_like_no_recompute_in_every_layout(runs, layout):
    ref_steps, ref_w = steps(runs / f"{layout}-none"), weights(runs / f"{layout}-none")
    assert len(ref_steps) == 4
    for policy in policies(layout)[1:]:
        run = runs / f"{layout}-{policy}"
        assert steps(run) == ref_steps, (policy, steps(run), ref_steps)
        w = weights(run)
        bad = [n for n in ref_w if not (w[n] == ref_w[n]).all()]
        assert not bad, (policy, bad[:4])
