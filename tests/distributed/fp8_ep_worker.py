"""torchrun worker (2 ranks): expert parallelism with FP8 experts trains like one process.

The MoE of expert_parallel_worker.py (8 routed experts top-2, a shared expert, MTP, balancing)
with `precision.fp8` on trains 5 AdamW steps on a fixed global batch of 8 sequences: on one
process (rank 0, no process group), then at dp = 2, ep = 2 (all-to-all). Each CASE is
`recipe` or `recipe:experts` (only the experts in FP8, every dense linear kept in high
precision). Rank 0 writes per case the largest relative differences of the losses, gradient
norms and gradients from the one-process run (see `compare`), and how many experts each rank
holds.

Why `current:experts`: a per-tensor scale depends on which rows share the tensor. Under
ep each expert receives its rows from the whole global batch, in global order, as on one
process, so FP8 experts quantize identically; a dense linear under dp sees only its rank's
rows, so its current-scaling scale differs from the one-process scale -- which is data
parallelism's FP8 semantics (as in TE), not an expert-parallel effect. Blockwise scales
are per 1 x 128 row tile and per weight block, independent of the batch, so every layer can
be FP8 there.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from expert_parallel_worker import (  # torchrun puts this directory on sys.path
    MODEL,
    compare,
    learnable_tokens,
    train,
)

from hyperloom.accelerator import get_accelerator
from hyperloom.config import load_config
from hyperloom.parallel import build_mesh, init_distributed, parallelize
from hyperloom.parallel.mesh import ParallelMesh, exit_worker, parse_order

DENSE = ["*attention*", "w1", "w2", "w3", "*mtp*"]  # leaf names of dense and shared linears


def options(case: str) -> list[str]:
    recipe, _, only = case.partition(":")
    keep = ["tok_embeddings", "*embed*", "output", "lm_head", "*router*", "*.gate", "*norm*"]
    keep += DENSE if only == "experts" else []
    return [*MODEL, "--precision.fp8", recipe, "--precision.fp8_keep", ",".join(keep)]


def main() -> None:
    report_path, cases = sys.argv[1], sys.argv[2:]
    acc = get_accelerator("cpu")
    init_distributed(acc)
    tokens = learnable_tokens()  # (steps, batch, seq + 1), as in expert_parallel_worker
    report = {}
    for case in cases:
        ref = None
        if dist.get_rank() == 0:
            cfg = load_config(None, options(case), world_size=1)
            order = parse_order(cfg.parallel.order)
            mesh = ParallelMesh(dict.fromkeys(order, 1), order)
            ref = train(parallelize(cfg, mesh, acc.device), cfg, slice(None), tokens)
        dist.barrier()
        over = ["--parallel.dp", "2", "--parallel.ep", "2"]
        cfg = load_config(None, options(case) + over, world_size=2)
        pm = parallelize(cfg, build_mesh(cfg.parallel, acc), acc.device)
        experts = pm.inner.layers["1"].feed_forward.experts
        rank = pm.mesh.rank("dp")
        got = train(pm, cfg, slice(rank * 4, rank * 4 + 4), tokens)
        if ref is not None:
            first = compare(*({k: v[:1] for k, v in run.items()} for run in (ref, got)))
            report[case] = {
                **compare(ref, got),
                "grad_step1": first["grad"],
                "local_experts": experts.w1.shape[0],
                "fp8_experts": getattr(experts.recipe, "name", None),
                "reference_loss": ref["loss"],
            }
    if dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump(report, f, indent=2)
    exit_worker(0)


if __name__ == "__main__":
    main()
