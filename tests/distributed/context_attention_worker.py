"""Worker: context-parallel attention against whole-sequence attention, forward and backward.

Usage: torchrun --nproc-per-node CP context_attention_worker.py OUT.json

Every rank draws the same random q, k, v for a sequence of 2 x cp x c tokens (c odd, so the
chunks are odd-sized), runs attention over the whole sequence in one process's way
(the float32 reference, causal) and its own part through `ContextShard.attention` in each
form, and compares its output and the gradients of its part of q, k, v. Cases cover
grouped-query heads (Llama: kv heads 2 of 4, also fewer kv heads than cp) and MLA's shape
(as many k as q heads, v narrower than q and k). Rank 0 writes the largest relative errors.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from hyperloom.engine.ops.attention import attention_reference
from hyperloom.parallel.context_parallel import ContextShard
from hyperloom.parallel.mesh import exit_worker

CASES = {  # name: (q heads, kv heads, qk head dim, v head dim)
    "gqa": (4, 2, 8, 8),
    "gqa-1kv": (4, 1, 8, 8),
    "mla": (4, 4, 12, 8),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def main() -> None:
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    errors = {}
    for c in (1, 3):
        seq = 2 * cp * c
        for name, (hq, hk, d, dv) in CASES.items():
            for form in ("ring", "alltoall"):
                if form == "alltoall" and hq % cp:
                    continue
                shard = ContextShard(cp, rank, group, form)
                gen = torch.Generator().manual_seed(seq * 100 + hq + hk + d)
                q, k = (torch.randn(2, h, seq, d, generator=gen) for h in (hq, hk))
                v = torch.randn(2, hk, seq, dv, generator=gen)
                dout = torch.randn(2, hq, seq, dv, generator=gen)
                whole = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = attention_reference(*whole, is_causal=True)
                ref.backward(dout)
                mine = [shard.shard(t, dim=2).requires_grad_() for t in (q, k, v)]

                def core(q_, k_, v_):
                    return attention_reference(q_, k_, v_, is_causal=True)

                out = shard.attention(*mine, core)
                out.backward(shard.shard(dout, dim=2))
                err = [rel(out, shard.shard(ref, dim=2))]
                err += [
                    rel(m.grad, shard.shard(w.grad, dim=2))
                    for m, w in zip(mine, whole, strict=True)
                ]
                worst = torch.tensor(max(err))
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                errors[f"{form}/{name}/seq{seq}"] = worst.item()
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(errors, f, indent=1)
    sys.exit(exit_worker(0))


if __name__ == "__main__":
    main()
