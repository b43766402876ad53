"""Resharding is exact: model and Adam state go tp2 x dp2 (ZeRO-1) -> dp4 (FSDP2) -> tp2 x dp2,
and a MoE's dp4 x ep2 (ZeRO-1) -> dp4 x ep2 (FSDP2) -> dp4 x ep4 (ZeRO-1) -> one process, and
come back bitwise equal (`reshard_worker.py`, one torchrun launch of 4 ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_state_round_trip_across_layouts_is_bitwise(tmp_path):
    out = tmp_path / "reshard.json"
    worker = Path(__file__).with_name("reshard_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    result = subprocess.run(
        [*cmd, str(worker), str(out)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["same_names"] and report["tensors"] > 40  # weights, exp_avg, exp_avg_sq, step
    assert report["differ_after_dp4"] == []
    assert report["differ_after_back"] == []
    # a DeepSeek MoE: dp4 x ep2 ZeRO-1 -> FSDP2 -> ep4 ZeRO-1 -> one process
    experts = report["experts"]
    assert experts["tensors"] > 100 and experts["biases_moved"], experts
    for key in ("differ_after_fsdp", "differ_after_ep4", "differ_one_process"):
        assert experts[key] == [], (key, experts[key])
