"""`parallel.ep_overlap` without a pipeline: gradient accumulation's micro-batch i forward
beside micro-batch i-1's backward (`hyperloom.parallel.overlap_accum`), through the harness
of `test_ep_overlap.py` (`overlap_worker.py`).

Each layout trains two steps of four accumulated micro-batches with the overlap off and on:
losses, gradient norms and every weight afterwards must be bitwise equal, under DDP (whose
reduction the overlapped step runs by hand after the micro-batches) and ZeRO-1. The trace of
the overlapped step must show each all-to-all in flight while the other micro-batch computed,
unless that one had already finished.
"""

from __future__ import annotations

import pytest
from conftest import override_args
from test_ep_overlap import _check, _run

ACC = override_args(train__grad_accum=4)

WORLD2 = {
    "dp2-ep2-ddp": [*ACC, *override_args(parallel__dp=2, parallel__ep=2, parallel__zero=0)],
    "dp2-ep2-zero1": [*ACC, *override_args(parallel__dp=2, parallel__ep=2, parallel__zero=1)],
    # delayed FP8: the replicas' newest amaxes reduced after every pair, as after every
    # micro-batch without the overlap
    "dp2-ep2-ddp-fp8-delayed": [
        *ACC,
        *override_args(parallel__dp=2, parallel__ep=2, precision__fp8="delayed"),
    ],
    # the experts' dispatch runs again inside the backward lane
    "dp2-ep2-ddp-recompute": [
        *ACC,
        *override_args(parallel__dp=2, parallel__ep=2, train__recompute="full"),
    ],
}
WORLD4 = {
    # DDP at dp x cp > 2 reduces a MoE model's gradients one by one; the overlap matches it
    "dp4-ep4-ddp": [*ACC, *override_args(parallel__dp=4, parallel__ep=4, parallel__zero=0)],
    "dp4-ep2-zero1": [*ACC, *override_args(parallel__dp=4, parallel__ep=2, parallel__zero=1)],
}


LAYOUTS = {2: WORLD2, 4: WORLD4}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The worker's report for a world size, one torchrun launch per size."""
    done: dict[int, dict] = {}

    def of(world: int) -> dict:
        if world not in done:
            tmp = tmp_path_factory.mktemp(f"accum{world}")
            done[world] = _run(tmp, world, LAYOUTS[world])
        return done[world]

    return of


@pytest.mark.parametrize(
    "world,layout", [(w, name) for w, cases in LAYOUTS.items() for name in cases]
)
def test_accumulation_overlap_is_exact_and_overlaps(report, world, layout):
    r = report(world)[layout]
    _check(r)
    assert r["pairs"] == 3 * world, r  # F_i beside B_{i-1}, i = 1..3, on every rank
