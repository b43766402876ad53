"""torchrun worker (2 ranks): FP8 experts on expert tensor-parallel slices train like one
process.

Usage: torchrun --nproc-per-node 2 etp_compose_worker.py OUT.json CASE [CASE ...], each
CASE a recipe (`current`) or a recipe under sequence parallelism (`delayed:sp`).

The MoE of expert_parallel_worker.py (8 routed experts top-2, a shared expert, MTP) at a
width where every tensor-parallel shard and every etp slice is whole 128-wide blocks (MLA's
8 heads of 32 + 32, expert width 256: 128 per etp rank), with only the routed experts in FP8
(`precision.fp8_keep` holds every dense linear, so the one-process comparison sees the etp
slices' FP8 and nothing else of it), trains 5 AdamW steps (`expert_parallel_worker.train`) on
the same global batch: on one process (rank 0), as a control and in the etp layout. A recipe
case compares tp 2 x etp 2 with tp 2 with the experts whole on both ranks (etp 1: the same
tensor-parallel attention, so the experts see the same rows); a `:sp` case compares tp 2 x
etp 2 under sequence parallelism (each rank routes half of every sequence, the bank gathers
the group's rows) with tp 2 x etp 2 without. Rank 0 writes per case the relative differences
of each step's loss and gradient norm and of the first step's whole gradients, of the etp
run from the control and from one process, and, for delayed scaling, whether the per-expert
amax histories and scales are bitwise equal on the two etp ranks and how far they are from
the one-process ones.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from expert_parallel_worker import MODEL, compare, learnable_tokens, train

from hyperloom.accelerator import get_accelerator
from hyperloom.config import load_config
from hyperloom.engine.fp8 import fp8_state_dict
from hyperloom.engine.fp8.convert import fp8_modules
from hyperloom.parallel import build_mesh, build_parallel_model, init_distributed
from hyperloom.parallel.mesh import ParallelMesh, exit_worker, parse_order

WIDE = ["--model.n_heads", "8", "--model.n_kv_heads", "8", "--model.qk_nope_head_dim", "32",
        "--model.qk_rope_head_dim", "32", "--model.v_head_dim", "32", "--model.ffn_dim", "256",
        "--model.moe_ffn_dim", "256"]  # fmt: skip
KEEP = "tok_embeddings,*embed*,output,lm_head,*router*,*.gate,*norm*,*attention*,*.eh_proj,w1,w2,w3"


def options(recipe: str) -> list[str]:
    return [*MODEL, *WIDE, "--precision.fp8", recipe, "--precision.fp8_keep", KEEP]


def history_checks(pm, one) -> dict:
    """Delayed scaling: the routed experts' histories and scales of both etp ranks (equal
    bitwise?) and against the one-process ones (largest difference over the tensor's
    largest value); `one` is the one-process model on rank 0."""
    state = fp8_state_dict(pm.inner)
    flat = torch.cat([t.flatten() for _, t in sorted(state.items())])
    both = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(both, flat)
    if one is None:
        return {}
    ref = fp8_state_dict(one.inner)
    diff = max(
        ((ref[k] - t).abs().max() / ref[k].abs().max().clamp(min=1e-30)).item()
        for k, t in state.items()
    )
    return {
        "fp8_keys": len(state),
        "history_equal_across_ranks": bool(torch.equal(both[0], both[1])),
        "history_vs_one": diff,
    }


def per_step(ref: dict, got: dict) -> dict:
    """Relative differences of each step's loss and gradient norm."""
    return {
        key: [abs(a - b) / abs(a) for a, b in zip(ref[key], got[key], strict=True)]
        for key in ("loss", "norm")
    }


def layouts(case: str) -> dict[str, list[str]]:
    """The control and the etp layout of CASE (`recipe`, or `recipe:sp`)."""
    etp = ["--parallel.tp", "2", "--parallel.etp", "2"]
    if case.endswith(":sp"):  # each rank routes half of every sequence, gathered over etp
        return {"control": etp, "etp": [*etp, "--parallel.sp", "true"]}
    return {"control": ["--parallel.tp", "2", "--parallel.etp", "1"], "etp": etp}


def main() -> None:
    report_path, cases = sys.argv[1], sys.argv[2:]
    acc = get_accelerator("cpu")
    init_distributed(acc)
    tokens = learnable_tokens()  # (steps, batch, seq + 1)
    report = {}
    for case in cases:
        recipe = case.partition(":")[0]
        ref = one = None
        if dist.get_rank() == 0:  # one process: no groups, the whole batch
            cfg = load_config(None, options(recipe), world_size=1)
            order = parse_order(cfg.parallel.order)
            one = build_parallel_model(
                cfg, ParallelMesh(dict.fromkeys(order, 1), order), acc.device
            )
            ref = train(one, cfg, slice(None), tokens)
        dist.barrier()
        runs = {}
        for name, over in layouts(case).items():
            cfg = load_config(None, options(recipe) + over, world_size=2)
            pm = build_parallel_model(cfg, build_mesh(cfg.parallel, acc), acc.device)
            runs[name] = train(pm, cfg, slice(None), tokens)
        experts = pm.inner.layers["1"].feed_forward.experts
        scaling = history_checks(pm, one) if recipe == "delayed" else {}
        if ref is not None:
            got, control = runs["etp"], runs["control"]
            first = [{k: v[:1] for k, v in run.items()} for run in (ref, got, control)]
            report[case] = {
                "grad_step1_vs_one": compare(first[0], first[1])["grad"],
                "grad_step1_vs_control": compare(first[2], first[1])["grad"],
                "grad_step1_control_vs_one": compare(first[0], first[2])["grad"],
                "steps_vs_one": per_step(ref, got),
                "steps_vs_control": per_step(control, got),
                "steps_control_vs_one": per_step(ref, control),
                "grads_vs_one": compare(ref, got),  # all steps, with the worst tensor
                "w1_shape": list(experts.w1.shape),
                "fp8_experts": getattr(experts.recipe, "name", None),
                "fp8_modules": [name for name, _ in fp8_modules(pm.inner)],
                "reference_loss": ref["loss"],
                **scaling,
            }
    if dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump(report, f, indent=2)
    exit_worker(0)


if __name__ == "__main__":
    main()
