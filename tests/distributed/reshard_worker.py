"""torchrun worker (4 ranks): model and optimizer state survive tp2 x dp2 -> dp4 -> tp2 x dp2.

Layout A (tp 2 x dp 2, ZeRO-1) takes one AdamW step, so the Adam moments are not trivial, and
gathers its whole-tensor state (what a checkpoint holds). Layout B (dp 4, FSDP2) loads it and
gathers it again; layout A loads that and gathers once more. Rank 0 writes whether every
tensor came back bitwise equal, and the names of those that did not.
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
from hyperloom.parallel.mesh import exit_worker
from hyperloom.train.optim import build_optimizer

MODEL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--model.vocab_size", "256",
         "--data.seq_len", "16", "--precision.dtype", "fp32", "--train.device", "cpu"]  # fmt: skip


def layout(tp: int, dp: int, zero: int):
    over = ["--parallel.tp", str(tp), "--parallel.dp", str(dp), "--parallel.zero", str(zero)]
    cfg = load_config(None, MODEL + over, world_size=4)
    acc = get_accelerator("cpu")
    pm = build_parallel_model(cfg, build_mesh(cfg.parallel, acc), acc.device)
    return cfg, pm, build_optimizer(pm, cfg.train)


def gather(pm, opt) -> dict:
    return {"model": full_model_state(pm), "optimizer": full_optimizer_state(pm, opt)}


def flatten(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in state["model"].items()}
    for name, entry in state["optimizer"]["state"].items():
        out.update({f"optimizer/{name}/{k}": v for k, v in entry.items()})
    return out


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
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    exit_worker(0)


if __name__ == "__main__":
    main()
