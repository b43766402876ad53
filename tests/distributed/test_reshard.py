"""Resharding is exact: model and Adam state go tp2 x dp2 (ZeRO-1) -> dp4 (FSDP2) -> tp2 x dp2,
and a MoE's dp4 x ep2 (ZeRO-1) -> dp4 x ep2 (FSDP2) -> dp4 x ep4 (ZeRO-1) -> one process, and
come back bitwise equal (`reshard_worker.py`, one torchrun launch of 4 ranks). Adam state
loaded from a whole checkpoint into tensor-parallel shards also steps like the saved run's:
equal values are not enough when fused AdamW reads a strided view as if it were contiguous."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from conftest import run_workers
from torch import nn

from hyperloom import checkpoint as ckpt
from hyperloom.checkpoint.state import load_full_optimizer_state
from hyperloom.config import TrainConfig
from hyperloom.models.shard import Shard, set_shard
from hyperloom.train.optim import adamw


def test_state_round_trip_across_layouts_is_bitwise(tmp_path):
    out = tmp_path / "reshard.json"
    worker = Path(__file__).with_name("reshard_worker.py")
    run_workers(worker, 4, out, timeout=600)
    report = json.loads(out.read_text())
    assert report["same_names"] and report["tensors"] > 40  # weights, exp_avg, exp_avg_sq, step
    assert report["differ_after_dp4"] == []
    assert report["differ_after_back"] == []
    # a DeepSeek MoE: dp4 x ep2 ZeRO-1 -> FSDP2 -> ep4 ZeRO-1 -> one process
    experts = report["experts"]
    assert experts["tensors"] > 100 and experts["biases_moved"], experts
    for key in ("differ_after_fsdp", "differ_after_ep4", "differ_one_process"):
        assert experts[key] == [], (key, experts[key])


def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


@torch.no_grad()
def test_adam_state_loaded_into_tp_shards_steps_like_the_whole():
    """A whole checkpoint's moments, loaded into this rank's tensor-parallel slice, must step
    exactly as the whole tensor's slice does, for row-parallel (dim 1) slices too. They used to
    be loaded as views into the whole moments: a dim-1 slice is strided, and fused AdamW reads
    and writes state as if it were laid out like the contiguous parameter, so a tp > 1 run
    resumed from a whole checkpoint went wrong from its first step (wo and w2 weights)."""
    g = torch.Generator().manual_seed(0)
    whole, grad = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    state = {
        "step": torch.tensor(3.0),
        "exp_avg": torch.randn(6, 8, generator=g) * 0.1,
        "exp_avg_sq": torch.rand(6, 8, generator=g) * 0.01,
    }
    cfg = TrainConfig(lr=1e-2)
    p = nn.Parameter(whole.clone())
    opt = adamw(nn.ParameterList([p]), cfg)  # the trainer's: fused where torch has it
    opt.state[p] = {k: v.clone() for k, v in state.items()}
    p.grad = grad.clone()
    opt.step()
    for dim in (0, 1):
        for index in range(2):
            where = f"dim {dim} shard {index}"
            shard = Shard(dim, index, 2)
            piece = nn.Parameter(shard.piece(whole).clone())
            set_shard(piece, shard)
            opt_tp = adamw(nn.ParameterList([piece]), cfg)
            pm = SimpleNamespace(local_params=lambda piece=piece: [("w", piece)])
            load_full_optimizer_state(pm, opt_tp, {"state": {"w": state}})
            piece.grad = shard.piece(grad).clone()
            opt_tp.step()
            _assert_equal(piece, shard.piece(p), where)
            for k in ("exp_avg", "exp_avg_sq"):
                got, want = opt_tp.state[piece][k], shard.piece(opt.state[p][k])
                _assert_equal(got, want, f"{where} {k}")
                assert got.is_contiguous(), f"{where} {k}"  # laid out like the parameter


def test_whole_checkpoint_resumes_at_tp2_like_the_uninterrupted_run(
    tiny_job_args, jobs_train, tmp_path
):
    """tp = 2: a run stopped at step 2 (a whole checkpoint) and resumed at tp = 2 trains
    steps 3-4 and ends in the weights and Adam state of the uninterrupted run, bit for bit."""
    job = tiny_job_args(tmp_path / "unused", train__steps=4, parallel__tp=2)
    cases = [("straight", []), ("split", ["--train.stop_at_step", "2"]), ("split", [])]
    result = jobs_train(tmp_path, 2, job, cases)
    assert result.returncode == 0, result.stderr[-3000:]
    records = {}
    for name in ("straight", "split"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        train = [r for r in map(json.loads, lines) if r.get("event") == "train"]
        records[name] = {r["step"]: (r["loss"], r["grad_norm"]) for r in train}
    assert sorted(records["split"]) == [1, 2, 3, 4]
    assert records["split"] == records["straight"]  # exact, not approximate
    a, b = (ckpt.resolve_checkpoint(tmp_path / name) for name in ("straight", "split"))
    assert a.name == b.name == "step_00000004"
    wa, wb = ckpt.load_weights(a), ckpt.load_weights(b)
    assert sorted(wa) == sorted(wb)
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []
    oa, ob = (ckpt.load_train_state(c)["optimizer"]["state"] for c in (a, b))
    assert sorted(oa) == sorted(ob)
    differ = [f"{n}/{k}" for n in oa for k in oa[n] if not torch.equal(oa[n][k], ob[n][k])]
    assert differ == []
