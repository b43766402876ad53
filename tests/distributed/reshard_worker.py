"""torchrun worker (4 ranks): model and optimizer state survive tp2 x dp2 -> dp4 -> tp2 x dp2.

Layout A (tp 2 x dp 2, ZeRO-1) takes one AdamW step, so the Adam moments are not trivial, and
gathers its whole-tensor state (what a checkpoint holds). Layout B (dp 4, FSDP2) loads it and
gathers it again; layout A loads that and gathers once more. Rank 0 writes whether every
tensor came back bitwise equal, and the names of those that did not.

The same for a DeepSeek MoE (`expert_parallel_worker.MODEL`) with ep: dp4 x ep2 under ZeRO-1
(expert state sharded over the expert-data-parallel pairs) -> dp4 x ep2 under FSDP2 (expert
banks sharded over those pairs, routing biases whole) -> dp4 x ep4 under ZeRO-1 (experts
unsharded by it) -> one process (rank 0 alone).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from hyperloom.accelerator import get_accelerator
from hyperloom.checkpoint.state import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)
from hyperloom.config import load_config
from hyperloom.parallel import build_mesh, build_parallel_model, init_distributed
from hyperloom.parallel.mesh import ParallelMesh, exit_worker, parse_order
from hyperloom.train.optim import build_optimizer

MODEL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--model.vocab_size", "256",
         "--data.seq_len", "16", "--precision.dtype", "fp32", "--train.device", "cpu"]  # fmt: skip


def layout(tp: int, dp: int, zero: int, ep: int = 1, model: list[str] = MODEL):
    over = ["--parallel.tp", str(tp), "--parallel.dp", str(dp), "--parallel.zero", str(zero)]
    over += ["--parallel.ep", str(ep)]
    world = tp * dp
    cfg = load_config(None, model + over, world_size=world)
    acc = get_accelerator("cpu")
    if world == 1:  # one process: no groups (rank 0 alone)
        order = parse_order(cfg.parallel.order)
        mesh = ParallelMesh(dict.fromkeys(order, 1), order)
    else:
        mesh = build_mesh(cfg.parallel, acc)
    pm = build_parallel_model(cfg, mesh, acc.device)
    return cfg, pm, build_optimizer(pm, cfg.train)


def gather(pm, opt) -> dict:
    return {"model": full_model_state(pm), "optimizer": full_optimizer_state(pm, opt)}


def flatten(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in state["model"].items()}
    for name, entry in state["optimizer"]["state"].items():
        out.update({f"optimizer/{name}/{k}": v for k, v in entry.items()})
    return out


def differ(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))


def round_trip(gathered: dict, **where) -> dict:
    """`gathered` loaded into the layout `where` (as `layout` takes it), gathered again."""
    _, pm, opt = layout(**where)
    load_full_model_state(pm, gathered["model"])
    load_full_optimizer_state(pm, opt, gathered["optimizer"])
    return gather(pm, opt)


def experts_report() -> dict:
    """dp4 x ep2 ZeRO-1 after a step and a balancing update -> FSDP2 -> ep4 -> one process."""
    from expert_parallel_worker import MODEL as MOE
    from expert_parallel_worker import VOCAB

    _, pm, opt = layout(1, 4, 1, ep=2, model=MOE)
    tokens = torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(0))
    rows = slice(pm.mesh.rank("dp") * 2, (pm.mesh.rank("dp") + 1) * 2)
    pm.module(tokens[rows, :-1], labels=tokens[rows, 1:]).backward()
    pm.reduce_and_clip(opt, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    pm.inner.after_optimizer_step(pm.mesh.group("dcp"))  # routing biases off zero
    first = gather(pm, opt)
    fsdp = round_trip(first, tp=1, dp=4, zero=3, ep=2, model=MOE)
    ep4 = round_trip(fsdp, tp=1, dp=4, zero=1, ep=4, model=MOE)
    a, b, c = flatten(first), flatten(fsdp), flatten(ep4)
    report = {
        "tensors": len(a),
        "biases_moved": any(k.endswith("expert_bias") and a[k].abs().sum() > 0 for k in a),
        "differ_after_fsdp": differ(a, b),
        "differ_after_ep4": differ(a, c),
    }
    dist.barrier()
    if dist.get_rank() == 0:  # the whole state loads into one process, which gathers it back
        report["differ_one_process"] = differ(
            a, flatten(round_trip(ep4, tp=1, dp=1, zero=0, model=MOE))
        )
    dist.barrier()
    return report


def main() -> None:
    out = sys.argv[1]
    init_distributed(get_accelerator("cpu"))
    cfg, pm, opt = layout(2, 2, 1)
    mesh = pm.mesh
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    rows = slice(mesh.rank("dp") * 4, (mesh.rank("dp") + 1) * 4)
    x, y = tokens[rows, :-1], tokens[rows, 1:]
    pm.module(x, labels=y).backward()
    pm.reduce_and_clip(opt, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    first = gather(pm, opt)

    _, pm_b, opt_b = layout(1, 4, 3)
    load_full_model_state(pm_b, first["model"])
    load_full_optimizer_state(pm_b, opt_b, first["optimizer"])
    second = gather(pm_b, opt_b)

    _, pm_a, opt_a = layout(2, 2, 1)
    load_full_model_state(pm_a, second["model"])
    load_full_optimizer_state(pm_a, opt_a, second["optimizer"])
    third = gather(pm_a, opt_a)

    if dist.get_rank() == 0:
        a, b, c = flatten(first), flatten(second), flatten(third)
        report = {
            "tensors": len(a),
            "same_names": sorted(a) == sorted(b) == sorted(c),
            "differ_after_dp4": sorted(k for k in a if k in b and not torch.equal(a[k], b[k])),
            "differ_after_back": sorted(k for k in a if k in c and not torch.equal(a[k], c[k])),
        }
    experts = experts_report()
    if dist.get_rank() == 0:
        report["experts"] = experts
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    exit_worker(0)


if __name__ == "__main__":
    main()
