"""torchrun worker: what ZeRO-1's step allocates (`hyperloom.parallel.zero1`), on gloo.

Usage: torchrun --nproc-per-node 2 zero1_memory_worker.py OUT.json

A small Llama trains two steps with `ZeroOneAdamW` over the world. Rank 0 writes, for the
second step: whether every gradient autograd produced is a view of the optimizer's flat buffer
(accumulated in place), and the largest single allocation and the peak of live bytes that
`reduce_grads`, `clip_grad_norm` and `step` make (`AllocationTracker`), beside the sizes of the
whole flat space and of this rank's shard; and whether the reduce-scatter / all-gather
collectives (what NCCL-style backends use) give the same weights bit for bit.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hyperloom.config import ModelConfig, TrainConfig
from hyperloom.engine.ops.memory import AllocationTracker
from hyperloom.models.registry import init_model
from hyperloom.parallel.zero1 import ZeroOneAdamW

dist.init_process_group("gloo")
cfg = ModelConfig(
    vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32
)
model = init_model(cfg, "cpu", seed=0)
opt = ZeroOneAdamW(model, TrainConfig(), dist.group.WORLD)
other = init_model(cfg, "cpu", seed=0)
other_opt = ZeroOneAdamW(other, TrainConfig(), dist.group.WORLD, in_place=False)
gen = torch.Generator().manual_seed(dist.get_rank())
report = {}
for _ in range(2):
    opt.zero_grad(set_to_none=True)
    other_opt.zero_grad(set_to_none=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=gen)
    model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    other(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    other_opt.reduce_grads()
    other_opt.clip_grad_norm(1.0)
    other_opt.step()
    buffer = getattr(opt, "buffer", None)
    base = None if buffer is None else buffer.untyped_storage().data_ptr()
    views = all(p.grad.untyped_storage().data_ptr() == base for p in opt.params)
    with AllocationTracker() as t:
        opt.reduce_grads()
        opt.clip_grad_norm(1.0)
        opt.step()
    report = {
        "grads_are_buffer_views": views,
        "largest_bytes": t.largest_bytes,
        "peak_bytes": t.peak_bytes,
        "full_bytes": opt.padded * 4,
        "shard_bytes": opt.shard * 4,
        "scatter_gather_equal": all(
            torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True)
        ),
    }
if dist.get_rank() == 0:
    Path(sys.argv[1]).write_text(json.dumps(report))
dist.barrier()
dist.destroy_process_group()
