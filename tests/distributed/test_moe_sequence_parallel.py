"""Sequence parallelism for the DeepSeek family trains like one process (gloo workers on CPU).

The moe-tiny shape (MLA with a low-rank query, 16 experts top-2 in groups, a shared expert,
one MTP module, aux-loss-free balancing and the sequence-wise balance loss) at tp 2 + sp,
alone and with dp 2 x ep 2, pp 2 and cp 2, against one process with the same global batch:
losses and gradient norms within 1e-5 for steps 1-2, then `LATER_STEPS_TOL`
(`assert_same_training`). A second shape ("losses": no q_lora, so wq makes its own input
gradient whole, and the batch-wise balance and router z-losses strong enough to show) checks
that the balance losses are one process's. A run saved at tp 2 + sp resumes in one process.
One launch per world size (`jobs_worker.py`).

Measured (fp32, this container's CPU): steps 1-2 within 3.1e-7 of one process in every
layout; steps 3-5 losses within 1e-5, gradient norms within 6.4e-5 (tp2 and tp2 x dp2 x ep2:
the same numbers as tp 2 without sp, whose partial sums reorder the float additions; the
others within 1.2e-6). The checks are sharp: the loads counted on each rank's slice
(not summed over tp) move step 2's loss by 1e-4, the balance losses' sums over tp with a
summing backward move step 1's gradient norm by 2.4e-4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import override_args
from test_expert_parallel import MOE_TINY, assert_same_training

GLOBAL_BATCH = 4
REFERENCES = {
    "moe": {},
    "losses": {
        "model__q_lora_rank": 0,
        "model__moe_seq_aux_alpha": 0.01,
        "model__moe_aux_alpha": 0.01,
        "model__moe_z_loss": 0.001,
    },
}
SP = {"parallel__tp": 2, "parallel__sp": True}
# name: (world, reference, overrides); micro-batch sizes keep the global batch at 4 rows
LAYOUTS = {
    "tp2-sp": (2, "moe", {**SP, "train__micro_batch_size": 4}),
    "tp2-sp-losses": (2, "losses", {**SP, "train__micro_batch_size": 4}),
    "tp2-sp-dp2-ep2": (
        4,
        "moe",
        {**SP, "parallel__dp": 2, "parallel__ep": 2, "train__micro_batch_size": 2},
    ),
    # sequence-sharded activations between the stages; the MTP module on the last one
    "tp2-sp-pp2": (
        4,
        "moe",
        {**SP, "parallel__pp": 2, "parallel__microbatches": 2, "train__micro_batch_size": 2},
    ),
    # each sequence over cp x tp: the balance losses reduce over both
    "tp2-sp-cp2-losses": (4, "losses", {**SP, "parallel__cp": 2, "train__micro_batch_size": 4}),
}
SAVED = {**SP, "train__micro_batch_size": 4, "train__stop_at_step": 3}


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "train"]


@pytest.fixture(scope="module")
def trained(tiny_job_args, jobs_train, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-sp")
    job = tiny_job_args(out / "unused", **MOE_TINY)

    def launch(world: int, cases: list[tuple[str, dict]]) -> None:
        result = jobs_train(
            out / f"w{world}", world, job, [(n, override_args(**a)) for n, a in cases]
        )
        assert result.returncode == 0, result.stderr[-3000:]

    def layouts(world: int) -> list[tuple[str, dict]]:
        return [
            (name, {**REFERENCES[ref], **extra})
            for name, (w, ref, extra) in LAYOUTS.items()
            if w == world
        ]

    launch(2, [*layouts(2), ("saved", SAVED)])
    shutil.copytree(out / "w2" / "saved", out / "w1" / "resumed")  # resumed in one process
    refs = [
        (name, {**model, "train__micro_batch_size": GLOBAL_BATCH})
        for name, model in REFERENCES.items()
    ]
    launch(1, [*refs, ("resumed", {"train__micro_batch_size": GLOBAL_BATCH})])
    launch(4, layouts(4))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_sequence_parallel_trains_like_one_process(trained, name):
    world, ref, _ = LAYOUTS[name]
    one, got = read_metrics(trained / "w1" / ref), read_metrics(trained / f"w{world}" / name)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert_same_training(one, got)
    assert set(got[-1]["expert_load"]) == set(one[-1]["expert_load"])  # every MoE layer
    assert one[-1]["loss"] < one[0]["loss"]  # the reference trained


def test_moe_sequence_parallel_checkpoint_resumes_in_one_process(trained):
    """Saved at tp 2 + sp after step 3 (parameter names as one process's, the shards and
    routing biases whole), resumed in one process: steps 4-5 are the uninterrupted run's."""
    assert (trained / "w2" / "saved" / "checkpoints" / "step_00000003").is_dir()
    resumed = trained / "w1" / "resumed"
    summary = json.loads((resumed / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_run"]) == (5, 2)
    assert_same_training(read_metrics(trained / "w1" / "moe"), read_metrics(resumed))
