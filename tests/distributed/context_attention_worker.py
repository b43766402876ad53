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


def latent_case(cp: int, rank: int, group, seq: int) -> float:
    """MLA's ring that passes the compressed latent [c_kv ‖ k_pe] (width 6 + 4) and expands
    it with a shared up-projection W on each rank: output, the latent's gradient and W's
    gradient (summed over the ranks, as data parallelism sums it) against one process."""
    heads, nope, rope, dv, r = 4, 8, 4, 6, 6
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(2, heads, seq, nope + rope, generator=gen)
    latent = torch.randn(2, seq, r + rope, generator=gen)
    w = torch.randn(heads * (nope + dv), r, generator=gen) * 0.3
    dout = torch.randn(2, heads, seq, dv, generator=gen)

    def expand(lat, weight):
        c_kv, k_pe = lat.split([r, rope], dim=-1)
        kv = (c_kv @ weight.T).unflatten(-1, (heads, nope + dv))
        k_nope, v = kv.split([nope, dv], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, heads, -1)], dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)

    whole = [t.clone().requires_grad_() for t in (q, latent, w)]
    ref = attention_reference(whole[0], *expand(whole[1], whole[2]), is_causal=True)
    ref.backward(dout)
    shard = ContextShard(cp, rank, group, "ring")
    wq = w.clone().requires_grad_()
    mine = [shard.shard(q, dim=2).requires_grad_(), shard.shard(latent, dim=1).requires_grad_()]
    out = shard.latent_attention(mine[0], mine[1], lambda lat: expand(lat, wq), (wq,))
    out.backward(shard.shard(dout, dim=2))
    dw = wq.grad.clone()
    dist.all_reduce(dw, group=group)
    err = [rel(out, shard.shard(ref, dim=2)), rel(mine[0].grad, shard.shard(whole[0].grad, dim=2))]
    err += [rel(mine[1].grad, shard.shard(whole[1].grad, dim=1)), rel(dw, whole[2].grad)]
    worst = torch.tensor(max(err))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


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
        errors[f"ring/mla-latent/seq{seq}"] = latent_case(cp, rank, group, seq)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(errors, f, indent=1)
    sys.exit(exit_worker(0))


if __name__ == "__main__":
    main()
