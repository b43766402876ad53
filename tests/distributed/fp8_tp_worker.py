"""torchrun worker: FP8 training with tensor parallelism against one process, in one launch.

Usage: torchrun --nproc-per-node 2 fp8_tp_worker.py OUT.json CASE [CASE ...], each CASE
`recipe:sp` (e.g. `blockwise:1`) for the Llama model, or `recipe:sp:deepseek` for the MoE
preset's shape (MLA, a dense and an MoE layer, one MTP module; the loss is the model's own,
main + MTP + balance). For each case every rank builds the tp = 2 model with
`parallelize` (FP8 linears converted, then made tensor-parallel) and, on the side, the whole
FP8 model on one device with the same seed; both take STEPS SGD steps (FP32 master weights,
gradients clipped to 1) on the same batches. SGD, not Adam: Adam's first updates are about
lr * sign(g), so gradient elements at round-off level would move weights by lr either way and
later FP8 scales would differ for reasons unrelated to FP8. Rank 0 writes, per case, the
relative loss differences per step, the worst relative difference of the first step's
gradients (gathered over tp) and, for delayed scaling, whether the amax histories are bitwise
equal across ranks and their worst relative difference from the single process's.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from pipeline_worker import run_cases  # torchrun puts this directory on sys.path

from hyperloom.config import config_from_dict
from hyperloom.engine.fp8 import convert_to_fp8, fp8_state_dict, recipe_from_name, reset_fp8_state
from hyperloom.engine.fp8.convert import fp8_modules
from hyperloom.models.registry import build_model
from hyperloom.parallel import build_mesh, build_parallel_model

# Every tensor-parallel shard a whole number of 128-wide blocks (blockwise needs it).
MODEL = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=512, vocab_size=128)
# moe-tiny's MLA heads split into shards of 96 (q), 128 (kv) and 64 (wo) features: whole
# 32-wide MX blocks, not 128-wide ones; the vocabulary as small as Llama's above.
DEEPSEEK = dict(preset="moe-tiny", n_layers=2, vocab_size=128, mtp_depth=1)
SEQ, MBS, STEPS, LR = 16, 2, int(os.environ.get("FP8_TP_STEPS", 3)), 0.5


def reference_model(cfg, device) -> torch.nn.Module:
    """The whole FP8 model of `cfg` on one device, initialised from the job's seed."""
    ref = build_model(cfg.model)
    if cfg.precision.fp8 != "none":  # "none": the same comparison without FP8, a control
        convert_to_fp8(ref, recipe_from_name(cfg.precision.fp8), keep=cfg.precision.fp8_keep)
    ref.to_empty(device=device)
    ref.init_weights(cfg.train.seed)
    reset_fp8_state(ref)
    return ref


def run_case(case: str, acc) -> dict:
    recipe, sp, *fam = case.split(":")
    sp, deepseek = bool(int(sp)), fam == ["deepseek"]
    raw = {
        "model": {**(DEEPSEEK if deepseek else MODEL), "max_seq_len": SEQ},
        "parallel": {"tp": 2, "sp": sp},
        "precision": {"dtype": "fp32", "fp8": recipe},
        "train": {"micro_batch_size": MBS, "device": "cpu", "lr": 1e-2, "weight_decay": 0.1},
        "data": {"seq_len": SEQ},
    }
    cfg = config_from_dict(raw, world_size=2)
    mesh = build_mesh(cfg.parallel, acc)
    pm = build_parallel_model(cfg, mesh, acc.device)
    opt = torch.optim.SGD(pm.inner.parameters(), lr=LR)

    ref = reference_model(cfg, acc.device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

    gen = torch.Generator().manual_seed(1234)
    fp8 = list(fp8_modules(pm.inner))
    fp8_tp = [n for n, m in fp8 if hasattr(m, "sharded_roles")]
    out = {"case": case, "fp8_tp_layers": len(fp8_tp), "fp8_layers": len(fp8), "loss": []}
    out["abs_loss"] = []
    for step in range(STEPS):
        tokens = torch.randint(0, raw["model"]["vocab_size"], (MBS, SEQ + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        if deepseek:  # the model's loss: main + MTP + balance (vocab-parallel under tp)
            ref_loss = ref.train()(x, labels=y)
        else:
            ref_loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        loss = pm.module(x, labels=y) if deepseek else pm.loss(pm.module(x), y)
        loss.backward()
        pm.sync_fp8_replicas(recent=1)  # as the trainer: sp's routed experts over tp
        pm.finish_grads()
        if step == 0:
            ref_grads, worst = dict(ref.named_parameters()), torch.zeros(())
            for name, p in pm.inner.named_parameters():
                if p.grad is None:  # not trained (e.g. DeepSeek's balancing biases)
                    assert ref_grads[name].grad is None, name
                    continue
                g = pm.whole(p.grad, p)
                r = ref_grads[name].grad
                # clamp: delayed scaling's first step (unit scales) may flush a small
                # gradient to zeros on both sides
                worst = torch.maximum(worst, (g - r).norm() / r.norm().clamp(min=1e-30))
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            out["grad"] = worst.item()
        pm.clip_grad_norm(1.0)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        diff = abs(loss.item() - ref_loss.item())
        out["loss"].append(diff / abs(ref_loss.item()))
        out["abs_loss"].append(ref_loss.item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    if recipe == "delayed":
        mine, theirs = fp8_state_dict(pm.inner), fp8_state_dict(ref)
        assert mine and set(mine) == set(theirs), (sorted(mine)[:4], sorted(theirs)[:4])
        flat = torch.cat([v.reshape(-1) for _, v in sorted(mine.items())])
        parts = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(parts, flat, group=mesh.group("tp"))
        out["history_equal_across_ranks"] = bool(torch.equal(parts[0], parts[1]))
        worst = 0.0
        for key, value in mine.items():
            r = theirs[key]
            worst = max(worst, ((value - r).abs().max() / r.abs().max().clamp(min=1e-30)).item())
        out["history_vs_single"] = worst
    return out


if __name__ == "__main__":
    run_cases(run_case)
