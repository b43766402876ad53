"""torchrun worker: every pipeline schedule against the single-device model, in one launch.

Usage: torchrun --nproc-per-node N pipeline_worker.py OUT.json CASE [CASE ...], each CASE
`schedule:pp:tp:dp:sp:zero[:tied|untied[:layers-per-chunk]]`, e.g. `1f1b:2:1:1:0:0:untied:0-8`
(the embedding alone on the first chunk). For each case every rank builds its pipeline chunks and,
on the side, the whole model on one device with the same seed; both take two AdamW steps on
the same global batch. Rank 0 writes, per case, the relative differences of the two losses and
gradient norms, and the worst one over all gradients (each rank compares the parameters it
holds, gathered over tp; the maximum is taken over ranks). A failing case ends the launch.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from hyperloom.accelerator import get_accelerator
from hyperloom.config import config_from_dict
from hyperloom.models.registry import build_model
from hyperloom.parallel.mesh import build_mesh, exit_worker, init_distributed
from hyperloom.pipeline.runtime import build_pipeline
from hyperloom.train.optim import adamw, build_optimizer

MODEL = dict(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=128)
SEQ, MBS = 16, 2


def run_case(case: str, acc) -> dict:
    fields = case.split(":")
    kind, pp, tp, dp, sp, zero = fields[0], *map(int, fields[1:6])
    tied = len(fields) > 6 and fields[6] == "tied"
    layers = [int(n) for n in fields[7].split("-")] if len(fields) > 7 else []
    vpp = 2 if kind == "interleaved" else 1
    raw = {
        "model": {**MODEL, "max_seq_len": SEQ, "tie_embeddings": tied},
        "parallel": {
            "pp": pp,
            "tp": tp,
            "dp": dp,
            "sp": bool(sp),
            "zero": zero,
            "pp_schedule": kind,
            "vpp": vpp,
            "pp_layers": layers,
        },
        "precision": {"dtype": "fp32"},
        "train": {"micro_batch_size": MBS, "device": "cpu", "lr": 1e-2, "weight_decay": 0.1},
        "data": {"seq_len": SEQ},
    }
    cfg = config_from_dict(raw, world_size=pp * tp * dp)
    mesh = build_mesh(cfg.parallel, acc)
    pm = build_pipeline(cfg, mesh, acc.device)
    opt = build_optimizer(pm, cfg.train)
    m = pm.micro_batches

    ref = build_model(cfg.model)
    ref.to_empty(device=acc.device)
    ref.init_weights(cfg.train.seed)
    ref_opt = adamw(ref, cfg.train)

    gen = torch.Generator().manual_seed(1234)
    rows = MBS * m
    out = {"case": case, "loss": [], "grad": None}
    for step in range(2):
        tokens = torch.randint(0, MODEL["vocab_size"], (rows * dp, SEQ + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        ref_loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        mine = slice(mesh.rank("dp") * rows, (mesh.rank("dp") + 1) * rows)
        loss = pm.run_step(x[mine], y[mine])
        loss = loss.clone()
        if mesh.group("dp") is not None:
            dist.all_reduce(loss, group=mesh.group("dp"))
            loss /= dp
        out["loss"].append(abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        sharded_opt = hasattr(opt, "reduce_grads")  # ZeRO-1: grads end up dp-sharded
        if step == 0 and not sharded_opt:
            pm.finish_grads()
            pm.sum_shared_grads()
            pm._dp_mean_grads()
            ref_grads = dict(ref.named_parameters())
            worst = torch.zeros(())
            for name, p in pm.local_params():
                g = pm.whole(p.grad, p)
                r = ref_grads[name].grad
                worst = torch.maximum(worst, (g - r).norm() / r.norm())
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            out["grad"] = worst.item()
            norm = pm.clip_grad_norm(1.0)
        else:
            norm = pm.reduce_and_clip(opt, 1.0)
        # The reference norm in float64: torch's foreach norm loses ~1e-5 in float32.
        grads = [p.grad for p in ref.parameters()]
        ref_norm = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt()
        torch._foreach_mul_(grads, torch.clamp(1.0 / (ref_norm.float() + 1e-6), max=1.0))
        out.setdefault("norm", []).append(abs(norm.item() - ref_norm.item()) / ref_norm.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    return out


def main() -> None:
    run_cases(run_case)


def run_cases(run_case) -> None:
    """The torchrun worker loop: `run_case(case, acc)` for each CASE argument, results as
    JSON from rank 0 (also used by other one-launch workers, e.g. fp8_tp_worker.py)."""
    out_path, cases = sys.argv[1], sys.argv[2:]
    acc = get_accelerator("cpu")
    init_distributed(acc)
    torch.manual_seed(0)
    results = []
    for case in cases:
        try:
            results.append(run_case(case, acc))
        except Exception:
            # Die loudly: the other ranks may be blocked in a receive from this one, and
            # torchrun stops them when a rank exits with an error.
            traceback.print_exc()
            sys.stderr.write(f"rank {dist.get_rank()}: case {case} failed\n")
            sys.stderr.flush()
            os._exit(1)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    exit_worker(0)


if __name__ == "__main__":
    main()
