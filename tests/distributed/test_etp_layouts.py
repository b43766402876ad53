"""Expert tensor parallelism (`parallel.etp`) composed with FSDP2, sequence parallelism at
etp < tp, and sharded checkpoints (gloo workers on CPU).

Training (`jobs_worker.py`, one launch per world size): the moe-tiny shape at tp 2 x etp 2 x
dp 2 under FSDP2 (zero = 3; the etp slices sharded over dp), at tp 2 x etp 2 x dp 4 x ep 2
under FSDP2 (each rank's etp slices of its experts sharded over their expert-data-parallel
pair), at tp 4 x etp 2 with sequence parallelism (two etp groups per tp group each route
their own rows through the same slices, whose gradients are summed over the ranks holding
them), alone, x dp 2 x ep 2 under FSDP2 (dp = ep: the experts left whole) and under ZeRO-1, and
x pp 2 (two micro-batches of two rows), against one
process with the same global batch: losses and gradient norms within 1e-5 for steps 1-2,
then `LATER_STEPS_TOL` (`assert_same_training`), three steps. A tp 4 x etp 2 x sp run saved
after step 2 resumes in one process.

Sharded checkpoints (`etp_layouts_worker.py`, 4 ranks): written at tp 2 x etp 2 x dp 2 x ep 2
(each rank a quarter of every expert weight, at its 2-D offsets) and loaded at etp 1, ep 1,
tp 4 x etp 2, dp 4 x ep 4, FSDP2 and in one process, and the way back, bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_workers
from sharded_checkpoint_worker import whole
from test_expert_parallel import MOE_TINY, assert_same_training
from test_expert_tensor_parallel import GLOBAL_BATCH, read_metrics, train_layouts

from hyperloom import checkpoint as ckpt
from hyperloom.config import load_config
from hyperloom.train.trainer import Trainer

ETP = {"parallel__tp": 2, "parallel__etp": 2}
TP4_SP = {"parallel__tp": 4, "parallel__etp": 2, "parallel__sp": True}
# name: (world, overrides); micro-batch sizes keep the global batch at 4 rows
LAYOUTS = {
    "tp2-etp2-dp2-zero3": (4, {**ETP, "parallel__dp": 2, "parallel__zero": 3}),
    "tp4-etp2-sp": (4, TP4_SP),
    "tp4-etp2-sp-dp2-ep2-zero3": (
        8,
        {**TP4_SP, "parallel__dp": 2, "parallel__ep": 2, "parallel__zero": 3},
    ),
    # dp > ep: FSDP2 shards each rank's etp slices of its experts over their two replicas
    "tp2-etp2-dp4-ep2-zero3": (
        8,
        {**ETP, "parallel__dp": 4, "parallel__ep": 2, "parallel__zero": 3},
    ),
    # sp at etp < tp under ZeRO-1 (the slices' sum over etp_replica before its reduction)
    # and under a pipeline (the same sum after the schedule)
    "tp4-etp2-sp-dp2-ep2-zero1": (
        8,
        {**TP4_SP, "parallel__dp": 2, "parallel__ep": 2, "parallel__zero": 1},
    ),
    "pp2-tp4-etp2-sp": (8, {**TP4_SP, "parallel__pp": 2, "parallel__microbatches": 2}),
}
# Three steps: steps 1-2 hold the 1e-5 bar, step 3 the looser one; moe-tiny's five cost a
# launch of eight ranks on two cores as much again.
STEPS = {"train__steps": 3, "train__warmup_steps": 1}
SAVED = {**TP4_SP, "train__micro_batch_size": 4, "train__stop_at_step": 2}


def micro_batch(layout: dict) -> int:
    return GLOBAL_BATCH // layout.get("parallel__dp", 1) // layout.get("parallel__microbatches", 1)


@pytest.fixture(scope="module")
def trained(tiny_job_args, jobs_train, tmp_path_factory):
    out = tmp_path_factory.mktemp("etp-layouts")
    job = tiny_job_args(out / "unused", **{**MOE_TINY, **STEPS})
    layouts = {
        name: (w, {**extra, "train__micro_batch_size": micro_batch(extra)})
        for name, (w, extra) in LAYOUTS.items()
    }
    return train_layouts(out, job, jobs_train, layouts, SAVED, 4)


@pytest.mark.slow  # three torchrun launches (4, 1 and 8 ranks): ~2 min on two cores
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_etp_layout_trains_like_one_process(trained, name):
    world, _ = LAYOUTS[name]
    one, got = read_metrics(trained / "w1" / "moe"), read_metrics(trained / f"w{world}" / name)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert_same_training(one, got)
    assert one[-1]["loss"] < one[0]["loss"]  # the reference trained


@pytest.mark.slow
def test_tp4_etp2_sp_checkpoint_resumes_in_one_process(trained):
    """Saved at tp 4 x etp 2 x sp after step 2 (expert slices gathered over etp, the other
    etp group's copies equal after their gradient sum), resumed in one process."""
    assert (trained / "w4" / "saved" / "checkpoints" / "step_00000002").is_dir()
    resumed = trained / "w1" / "resumed"
    summary = json.loads((resumed / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_run"]) == (3, 1)
    assert_same_training(read_metrics(trained / "w1" / "moe"), read_metrics(resumed))


# ------------------------------------------------------------------ sharded checkpoints


def _one_process(run_dir: Path, **overrides) -> Trainer:
    from conftest import tiny_job
    from etp_layouts_worker import HEADS
    from sharded_checkpoint_worker import COMMON, MOE

    args = tiny_job(run_dir, **{**COMMON, **MOE, **HEADS, "parallel__dp": 1, **overrides})
    return Trainer(load_config(None, args, world_size=1))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("etp-sharded")
    one = _one_process(out / "one")  # the way in: a one-process checkpoint
    one.run()
    torch.save(whole(one), out / "one" / "reference.pt")
    worker = Path(__file__).with_name("etp_layouts_worker.py")
    run_workers(worker, 4, out / "w4", out / "one", timeout=600)
    return out


def test_sharded_etp_checkpoint_reshards_bitwise(sharded):
    report = json.loads((sharded / "w4" / "report.json").read_text())
    assert report["tensors"] > 100  # weights, exp_avg, exp_avg_sq, step of ~35 parameters
    names = ["etp1", "ep1", "tp4_etp2", "dp4_ep4", "fsdp", "fsdp_ep2"]
    names += ["etp1_to_a", "tp4_etp2_to_a", "dp4_ep4_to_fsdp", "fsdp_to_a", "one_process_to_a"]
    for name in names:
        assert report[f"step_{name}"] == 2, name
        assert report[f"same_names_{name}"], name
        assert report[f"differ_{name}"] == [], name


def test_an_expert_weight_is_saved_as_quarters_at_their_offsets(sharded):
    """The 2-level split in DCP's metadata: (E=8, hidden=32, dim=64) w1 in four chunks of
    (4, 16, 64), at the expert offsets 0 and 4 (ep) times the hidden offsets 0 and 16 (etp)."""
    import torch.distributed.checkpoint as dcp

    step2 = sharded / "w4" / "a" / "checkpoints" / "step_00000002"
    meta = dcp.FileSystemReader(str(step2)).read_metadata().state_dict_metadata
    w1, w2 = "layers.1.feed_forward.experts.w1", "layers.1.feed_forward.experts.w2"
    for key in (f"model/{w1}", f"optimizer/{w2}/exp_avg"):
        chunks = meta[key].chunks
        w2 = "w2" in key
        assert tuple(meta[key].size) == ((8, 64, 32) if w2 else (8, 32, 64)), key
        got = sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks)
        hidden = 2 if w2 else 1
        want = []
        for e in (0, 4):
            for h in (0, 16):
                offsets, sizes = [e, 0, 0], [4, 64, 64]
                offsets[hidden], sizes[hidden] = h, 16
                want.append((tuple(offsets), tuple(sizes)))
        assert got == sorted(want), key


def test_sharded_etp_checkpoint_loads_in_one_process_bitwise(sharded, tmp_path):
    step2 = sharded / "w4" / "a" / "checkpoints" / "step_00000002"
    t = _one_process(tmp_path, checkpoint__resume=str(step2))
    t.maybe_resume()
    t.guard.close()
    assert t.step == 2
    got, reference = whole(t), torch.load(sharded / "w4" / "reference.pt")
    assert sorted(got) == sorted(reference)
    assert [k for k in reference if not torch.equal(reference[k], got[k])] == []
    weights = ckpt.load_model_state(step2)  # what generate/convert read: whole tensors
    assert all(torch.equal(weights[k], reference[f"model/{k}"]) for k in weights)
