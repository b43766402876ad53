"""torchrun worker (4 ranks): expert-parallel layouts train exactly like one process.

A small DeepSeek-style MoE (MLA, 8 routed experts top-2 in 2 groups, a shared expert, one MTP
module, aux-loss-free balancing and the sequence-wise balance loss on) trains 5 AdamW steps
on a fixed global batch of 8 sequences: once on one process (rank 0, no process group), then
at dp = 4 with ep = 1, 2 and 4, with both dispatchers, and with ZeRO-1 and FSDP2 (also at tp 2
x dp 2). Every layout records each step's loss (mean over dp), gradient norm, every gradient
gathered whole (not under ZeRO-1, whose optimizer holds the reduced ones) and the weights
after the last step; rank 0 writes the largest relative differences from the one-process run
to the JSON report.
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.distributed as dist

from hyperloom.accelerator import get_accelerator
from hyperloom.config import load_config
from hyperloom.parallel import build_mesh, build_parallel_model, init_distributed
from hyperloom.parallel.mesh import ParallelMesh, exit_worker, parse_order
from hyperloom.parallel.zero1 import ZeroOneAdamW
from hyperloom.train.optim import build_optimizer

STEPS, BATCH, SEQ, VOCAB = 5, 8, 16, 128
MODEL = ["--model.preset", "moe-tiny", "--model.vocab_size", str(VOCAB), "--model.dim", "64",
         "--model.n_layers", "3", "--model.n_heads", "2", "--model.n_kv_heads", "2",
         "--model.ffn_dim", "96", "--model.n_routed_experts", "8", "--model.moe_ffn_dim", "32",
         "--model.moe_n_groups", "2", "--model.moe_topk_groups", "1", "--model.q_lora_rank", "32",
         "--model.kv_lora_rank", "24", "--model.qk_nope_head_dim", "16",
         "--model.qk_rope_head_dim", "8", "--model.v_head_dim", "16",
         "--model.moe_bias_rate", "0.01", "--data.seq_len", str(SEQ),
         "--precision.dtype", "fp32", "--train.device", "cpu", "--train.lr", "3e-3",
         "--train.grad_clip", "0.5"]  # fmt: skip
LAYOUTS = {  # name: (tp, ep, dispatcher, zero), dp = 4 / tp
    "ep1-alltoall": (1, 1, "alltoall", 0),
    "ep2-alltoall": (1, 2, "alltoall", 0),
    "ep4-alltoall": (1, 4, "alltoall", 0),
    "ep2-allgather": (1, 2, "allgather", 0),
    "ep4-allgather": (1, 4, "allgather", 0),
    "ep2-zero1": (1, 2, "alltoall", 1),
    "ep4-zero1": (1, 4, "alltoall", 1),  # dp = ep: the experts' state is not sharded
    "ep2-zero3": (1, 2, "alltoall", 3),
    "ep4-zero3": (1, 4, "alltoall", 3),  # dp = ep: FSDP2 leaves the experts whole
    "tp2-ep2-zero1": (2, 2, "alltoall", 1),
    "tp2-ep2-zero3": (2, 2, "alltoall", 3),
}


def train(pm, cfg, rows: slice, tokens: torch.Tensor, loss_scale: float = 1.0) -> dict:
    """STEPS steps on `rows` of each step's global batch; losses, norms, whole gradients.
    `loss_scale` (a power of two): backward from the loss times it, gradients divided by it
    before anything reads them -- the same update, output gradients scaled (see
    fp8_ep_worker.py for why)."""
    opt = build_optimizer(pm, cfg.train)
    dp_group = pm.mesh.group("dp")
    out = {"loss": [], "norm": [], "grads": []}
    for step in range(STEPS):
        batch = tokens[step, rows]  # (rows, seq + 1)
        loss = pm.module(batch[:, :-1], labels=batch[:, 1:])
        (loss * loss_scale).backward()
        if loss_scale != 1.0:
            for p in pm.inner.parameters():
                if p.grad is not None:
                    p.grad.div_(loss_scale)  # exact: a power of two
        norm = pm.reduce_and_clip(opt, cfg.train.grad_clip)
        grads = {}
        for name, p in pm.inner.named_parameters():
            if p.grad is not None and not isinstance(opt, ZeroOneAdamW):
                # a copy: DDP's gradients are views of its buckets, refilled every step
                g = p.grad.detach().clone()
                grads[name] = pm.whole(g, p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pm.inner.after_optimizer_step(dp_group)
        loss = loss.detach()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss /= dist.get_world_size(dp_group)
        out["loss"].append(loss.item())
        out["norm"].append(norm.item())
        out["grads"].append(grads)
    return out


def compare(ref: dict, got: dict) -> dict:
    """Largest relative differences: of the losses and norms, and of each gradient tensor
    (its norm of differences over its norm) over all steps, with the worst tensor's name."""
    loss = max(abs(a - b) / abs(a) for a, b in zip(ref["loss"], got["loss"], strict=True))
    norm = max(abs(a - b) / abs(a) for a, b in zip(ref["norm"], got["norm"], strict=True))
    # ZeRO-1 records no gradients (its optimizer holds the reduced ones): None
    grads = [(a, b) for a, b in zip(ref["grads"], got["grads"], strict=True) if b]
    grad, worst, names = 0.0 if grads else None, "", True
    for g_ref, g_got in grads:
        names = names and sorted(g_ref) == sorted(g_got)
        for n, a in g_ref.items():
            rel = ((a - g_got[n]).norm() / a.norm().clamp(min=1e-30)).item()
            if rel > grad:
                grad, worst = rel, n
    return {"loss": loss, "norm": norm, "grad": grad, "worst": worst, "same_names": names}


def whole_weights(pm) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective)."""
    return {name: pm.whole(p, p) for name, p in pm.inner.named_parameters()}


def weights_differ(ref: dict, got: dict) -> float:
    """The largest relative difference of a tensor (norm of differences over its norm)."""
    assert sorted(ref) == sorted(got)
    return max(((a - got[n]).norm() / a.norm().clamp(min=1e-30)).item() for n, a in ref.items())


def zero1_sharded(pm, cfg) -> bool | None:
    """Under ZeRO-1: whether this rank's optimizer state holds 1/dp of the dense parameters
    and 1/(dp / ep) of its ep rank's experts (None for other optimizers)."""
    opt = build_optimizer(pm, cfg.train)
    if not isinstance(opt, ZeroOneAdamW):
        return None
    dp = pm.mesh.size("dcp")
    routed = sum(pm.inner.get_parameter(n).numel() for n in pm.experts.names)
    dense = sum(p.numel() for p in pm.inner.parameters() if p.requires_grad) - routed
    replicas = dp // dist.get_world_size(pm.experts.group)
    return opt.shard == math.ceil(dense / dp) + math.ceil(routed / replicas)


def learnable_tokens() -> torch.Tensor:
    """(steps, batch, seq + 1) learnable sequences t_i = start + stride * i mod VOCAB, so the
    loss falls and the comparison is between models that train, not two that sit at chance."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (STEPS, BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (STEPS, BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def main() -> None:
    report_path = sys.argv[1]
    acc = get_accelerator("cpu")
    init_distributed(acc)
    tokens = learnable_tokens()
    ref = None
    if dist.get_rank() == 0:  # the one-process run: no groups, the whole batch
        cfg = load_config(None, MODEL, world_size=1)
        mesh = ParallelMesh(
            dict.fromkeys(parse_order(cfg.parallel.order), 1), parse_order(cfg.parallel.order)
        )
        one = build_parallel_model(cfg, mesh, acc.device)
        ref = train(one, cfg, slice(None), tokens)
        ref_weights = whole_weights(one)
    dist.barrier()
    report, ep1 = {}, None
    for name, (tp, ep, dispatcher, zero) in LAYOUTS.items():
        over = ["--parallel.tp", str(tp), "--parallel.dp", str(4 // tp), "--parallel.ep", str(ep)]
        over += ["--parallel.ep_dispatcher", dispatcher, "--parallel.zero", str(zero)]
        cfg = load_config(None, MODEL + over, world_size=4)
        pm = build_parallel_model(cfg, build_mesh(cfg.parallel, acc), acc.device)
        moe = pm.inner.layers["1"].feed_forward
        w1 = moe.experts.w1  # under FSDP2 a DTensor: its shape is the one over dp
        bias = moe.router.expert_bias
        rows = BATCH // pm.mesh.size("dp")
        rank = pm.mesh.rank("dp")
        got = train(pm, cfg, slice(rank * rows, (rank + 1) * rows), tokens)
        weights = whole_weights(pm)
        sharded = zero1_sharded(pm, cfg)
        ep1 = ep1 or got  # plain data parallelism: what expert parallelism must not change
        if ref is not None:
            report[name] = {
                **compare(ref, got),
                "vs_ep1": compare(ep1, got),
                "weights": weights_differ(ref_weights, weights),
                "local_experts": w1.shape[0],
                "held_experts": w1.to_local().shape[0] if hasattr(w1, "to_local") else None,
                "bias_whole": not hasattr(bias, "to_local") and bool(bias.abs().sum() > 0),
                "zero1_sharded": sharded,
            }
    if dist.get_rank() == 0:
        report["reference_loss"] = ref["loss"]
        with open(report_path, "w") as f:
            json.dump(report, f, indent=2)
    exit_worker(0)


if __name__ == "__main__":
    main()
