"""ZeRO-1 allocates nothing of the whole model's size per step (`zero1_memory_worker.py`).

Gradients accumulate in place in the optimizer's flat buffer, which is also the collectives'
input and output (on gloo an in-place all-reduce), so the update's temporaries are at most one
shard: the AdamW denominator. Before, each step flattened every gradient into a fresh
full-size copy and all-gathered the weights into another (largest allocation = the whole flat
space, which this test rejects). Measured on the worker's model (558,336 B of FP32 parameters):
before, largest 558,336 B and peak 1,116,672 B with gradients outside the buffer; now largest
and peak 279,168 B, one shard.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_workers


def test_zero1_step_allocates_at_most_a_shard(tmp_path):
    out = tmp_path / "zero1_memory.json"
    worker = Path(__file__).with_name("zero1_memory_worker.py")
    run_workers(worker, 2, out, timeout=300)
    r = json.loads(out.read_text())
    assert r["grads_are_buffer_views"], r
    assert r["shard_bytes"] * 2 == r["full_bytes"], r
    assert 0 < r["largest_bytes"] <= r["shard_bytes"], r
    assert r["peak_bytes"] <= r["shard_bytes"] * 1.05, r
    assert r["scatter_gather_equal"], r  # the NCCL-style collectives, run on gloo
