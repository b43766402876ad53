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

import torch
import torch.distributed as dist
from expert_parallel_worker import (  # torchrun puts this directory on sys.path
    MODEL,
    compare,
    learnable_tokens,
    train,
)

from hyperloom.accelerator import get_accelerator
from hyperloom.config import load_config
from hyperloom.engine.fp8 import fp8_state_dict, load_fp8_state_dict
from hyperloom.parallel import build_mesh, build_parallel_model, init_distributed
from hyperloom.parallel.mesh import ParallelMesh, exit_worker, parse_order

DENSE = ["*attention*", "w1", "w2", "w3", "*mtp*"]  # leaf names of dense and shared linears


def options(case: str) -> list[str]:
    recipe, _, only = case.partition(":")
    keep = ["tok_embeddings", "*embed*", "output", "lm_head", "*router*", "*.gate", "*norm*"]
    keep += DENSE if only == "experts" else []
    return [*MODEL, "--precision.fp8", recipe, "--precision.fp8_keep", ",".join(keep)]


def scaling_state_checks(pm, one) -> dict:
    """Delayed scaling's per-expert histories under ep (a collective; `one` is the
    one-process model on rank 0, None elsewhere): the state gathered whole from both ranks
    against the one-process state (largest difference relative to the tensor's largest
    value), and the checkpoint round trips ep = 2 -> one process and one process -> ep = 2,
    each exact when every expert's rows land on the right expert."""
    state = fp8_state_dict(pm.inner)  # whole (E, len, 9) buffers, gathered over ep
    theirs = [fp8_state_dict(one.inner) if one is not None else None]
    dist.broadcast_object_list(theirs, src=0)
    load_fp8_state_dict(pm.inner, theirs[0])  # one process -> ep = 2: each rank its experts
    back = fp8_state_dict(pm.inner)
    if one is None:
        return {}
    diff, worst = 0.0, ""
    for key, a in theirs[0].items():
        rel = ((a - state[key]).abs().max() / a.abs().max().clamp(min=1e-30)).item()
        if rel >= diff:
            diff, worst = rel, key
    load_fp8_state_dict(one.inner, state)  # ep = 2 -> one process
    again = fp8_state_dict(one.inner)
    return {
        "fp8_keys": sorted(state),
        "fp8_state": diff,
        "fp8_state_worst": worst,
        "ep_to_one": all(torch.equal(state[k], again[k]) for k in state),
        "one_to_ep": all(torch.equal(theirs[0][k], back[k]) for k in back),
    }


def main() -> None:
    report_path, cases = sys.argv[1], sys.argv[2:]
    acc = get_accelerator("cpu")
    init_distributed(acc)
    tokens = learnable_tokens()  # (steps, batch, seq + 1), as in expert_parallel_worker
    report = {}
    for case in cases:
        ref = one = None
        if dist.get_rank() == 0:
            cfg = load_config(None, options(case), world_size=1)
            order = parse_order(cfg.parallel.order)
            mesh = ParallelMesh(dict.fromkeys(order, 1), order)
            one = build_parallel_model(cfg, mesh, acc.device)
            # Delayed scaling's first step quantizes with unit scales, so the output
            # gradients' size matters there: give one process those each dp rank has.
            scale = 2.0 if case.startswith("delayed") else 1.0
            ref = train(one, cfg, slice(None), tokens, loss_scale=scale)
        dist.barrier()
        over = ["--parallel.dp", "2", "--parallel.ep", "2"]
        cfg = load_config(None, options(case) + over, world_size=2)
        pm = build_parallel_model(cfg, build_mesh(cfg.parallel, acc), acc.device)
        experts = pm.inner.layers["1"].feed_forward.experts
        rank = pm.mesh.rank("dp")
        got = train(pm, cfg, slice(rank * 4, rank * 4 + 4), tokens)
        scaling = scaling_state_checks(pm, one)
        if ref is not None:
            first = compare(*({k: v[:1] for k, v in run.items()} for run in (ref, got)))
            report[case] = {
                **compare(ref, got),
                **scaling,
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
