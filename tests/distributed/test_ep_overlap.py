"""`parallel.ep_overlap` changes no number and overlaps for real (`overlap_worker.py`).

Each layout trains two steps with the overlap off and on: losses, gradient norms and every
weight afterwards must be bitwise equal, since each lane runs the operations it runs alone,
in the same order. The overlapped step's trace must show each all-to-all in flight while the
other micro-batch computed, unless that one had already finished.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import override_args, run_workers

# The moe-tiny preset at test size: MLA, 16 experts top-2, a shared expert, one MTP module.
JOB = override_args(
    model__preset="moe-tiny",
    model__dim=128,
    model__n_layers=4,
    model__n_heads=4,
    model__n_kv_heads=4,
    model__ffn_dim=256,
    model__moe_ffn_dim=64,
    data__seq_len=32,
    data__max_corpus_mb=0.5,
    data__val_fraction=0.2,
    train__steps=2,
    train__warmup_steps=1,
    train__micro_batch_size=1,
    train__device="cpu",
    precision__dtype="fp32",
    logging__progress=False,
    logging__plot=False,
    logging__self_check="off",
)
PIPE = override_args(parallel__pp=2, parallel__ep=2, parallel__microbatches=4)

WORLD4 = {
    "dualpipe": [*PIPE, *override_args(parallel__dp=2, parallel__pp_schedule="dualpipe")],
    "dualpipev": [*PIPE, *override_args(parallel__dp=2, parallel__pp_schedule="dualpipev")],
    "interleaved": [
        *PIPE,
        *override_args(parallel__dp=2, parallel__pp_schedule="interleaved", parallel__vpp=2),
    ],
    "zb-v": [*PIPE, *override_args(parallel__dp=2, parallel__pp_schedule="zb-v")],
    # the experts' dispatch runs again inside the backward lane
    "dualpipe-recompute": [
        *PIPE,
        *override_args(parallel__dp=2, parallel__pp_schedule="dualpipe", train__recompute="full"),
    ],
    "dualpipe-fp8": [
        *PIPE,
        *override_args(parallel__dp=2, parallel__pp_schedule="dualpipe", precision__fp8="current"),
    ],
}
WORLD8 = {
    "dualpipe-ep4": [
        *override_args(parallel__pp=2, parallel__dp=4, parallel__ep=4, parallel__microbatches=4),
        *override_args(parallel__pp_schedule="dualpipe"),
    ],
}


def _run(tmp_path: Path, nproc: int, cases: dict[str, list[str]]) -> dict:
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"job": JOB, "cases": list(cases.items())}))
    out = tmp_path / "report.json"
    worker = Path(__file__).with_name("overlap_worker.py")
    run_workers(worker, nproc, out, spec, timeout=1200)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("overlap4"), 4, WORLD4)


@pytest.fixture(scope="module")
def world8(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("overlap8"), 8, WORLD8)


def _check(r: dict) -> None:
    assert r["loss"] == 0 and r["norm"] == 0 and r["weights"] == 0, r
    assert r["ref_loss"][1] < r["ref_loss"][0]  # it trained
    assert r["pairs"] > 0 and r["comm"] > 0, r
    # Every all-to-all meets the other lane computing, unless that lane has ended.
    assert r["violations"] == 0, r
    assert r["hidden"] >= r["comm"] // 2, r


@pytest.mark.parametrize("layout", list(WORLD4))
def test_overlap_is_exact_and_overlaps_ep2(world4, layout):
    _check(world4[layout])


def test_overlap_is_exact_and_overlaps_ep4(world8):
    _check(world8["dualpipe-ep4"])
