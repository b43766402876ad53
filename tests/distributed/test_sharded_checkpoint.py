"""Sharded (DCP) checkpoints reshard exactly and are verified before they are loaded.

One torchrun launch of 4 ranks (`sharded_checkpoint_worker.py`): a tp2 x dp2 (ZeRO-1) run
saves asynchronously with `checkpoint.format = "sharded"`, every rank writing its shards;
dp4 under FSDP2 and under ZeRO-1, tp2 x dp2 under FSDP2 and pp2 x tp2 load the checkpoint
and must hold exactly the whole-tensor state the writer held (what the whole format would
have saved); three of them save it again in their layout and another layout loads that. A
small MoE saved at dp4 x ep2 loads at ep4 and ep1 exactly too. Here, in one process with no
process group, the same checkpoint must load bitwise too, and a corrupted shard or a missing
DCP `.metadata` must never be loaded: the previous committed checkpoint is, and the user is
told.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_workers

from hyperloom import checkpoint as ckpt
from hyperloom.checkpoint.state import full_model_state, full_optimizer_state
from hyperloom.config import load_config
from hyperloom.train.trainer import Trainer

COMMON = dict(train__steps=4, checkpoint__every=2, checkpoint__keep=3, checkpoint__format="sharded")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    worker = Path(__file__).with_name("sharded_checkpoint_worker.py")
    run_workers(worker, 4, out, timeout=600)
    return out


def test_sharded_save_at_tp2_dp2_loads_at_dp4_bitwise(launched):
    report = json.loads((launched / "report.json").read_text())
    assert report["tensors"] > 80  # 21 parameters: weights, exp_avg, exp_avg_sq, step
    layouts = ["dp4_fsdp", "dp4_zero1", "tp2_dp2_fsdp", "pp2_tp2"]
    layouts += ["dp4_fsdp_to_tp2_dp2_zero1", "tp2_dp2_fsdp_to_dp4_zero1", "pp2_tp2_to_dp4_zero1"]
    layouts += ["moe_ep4", "moe_ep1"]  # a MoE saved at dp4 x ep2 (experts split over ep)
    for layout in layouts:
        assert report[f"step_{layout}"] == (2 if layout.startswith("moe") else 4)
        assert report[f"same_names_{layout}"], layout
        assert report[f"differ_{layout}"] == [], layout
    step4 = launched / "run" / "checkpoints" / "step_00000004"
    shards = sorted(p.name for p in step4.glob("*.distcp"))
    assert shards == [f"__{r}_0.distcp" for r in range(4)]  # every rank wrote its part
    assert set(ckpt.verify_checkpoint(step4)["sha256"]) >= {".metadata", *shards}


def one_process(run_dir: Path, tiny_job_args, resume: str = "auto") -> Trainer:
    cfg = load_config(None, tiny_job_args(run_dir, **COMMON, checkpoint__resume=resume))
    trainer = Trainer(cfg)
    trainer.maybe_resume()
    trainer.guard.close()
    return trainer


def test_sharded_checkpoint_loads_in_one_process_bitwise(launched, tiny_job_args, tmp_path):
    step4 = launched / "run" / "checkpoints" / "step_00000004"
    t = one_process(tmp_path, tiny_job_args, resume=str(step4))
    assert t.step == 4
    got = {f"model/{k}": v for k, v in full_model_state(t.pm).items()}
    for name, entry in full_optimizer_state(t.pm, t.optimizer)["state"].items():
        got.update({f"optimizer/{name}/{k}": v for k, v in entry.items()})
    reference = torch.load(launched / "reference.pt")
    assert sorted(got) == sorted(reference)
    assert [k for k in reference if not torch.equal(reference[k], got[k])] == []
    weights = ckpt.load_model_state(step4)  # what generate/convert read: whole tensors
    assert all(torch.equal(weights[k], reference[f"model/{k}"]) for k in weights)


@pytest.mark.parametrize("kind", ["corrupt_shard", "no_dcp_metadata"])
def test_a_broken_sharded_checkpoint_is_never_loaded(kind, launched, tiny_job_args, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(launched / "run", run_dir)
    step4 = ckpt.checkpoint_root(run_dir) / "step_00000004"
    if kind == "corrupt_shard":  # one byte of rank 1's shard file
        f = step4 / "__1_0.distcp"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        (step4 / ".metadata").unlink()
    t = one_process(run_dir, tiny_job_args)
    assert t.resumed_from.name == "step_00000002" and t.step == 2
    log = (run_dir / "events.log").read_text()
    why = "__1_0.distcp does not match its SHA-256" if kind == "corrupt_shard" else "missing"
    assert why in log and "using step_00000002" in log
