"""Activation recompute per policy: what a transformer block keeps for its backward, measured,
beside what the planner predicts, and the training step's time.

For each `train.recompute` policy the default Llama block shapes (the job's `model` section,
BF16 autocast as training runs it) go through one forward with a saved-tensor hook that counts,
inside the blocks only, the bytes autograd keeps (each storage once, a dropped output at its
size after the drop, a checkpointed block's input as its checkpoint keeps it). The planner's
figure is `planner.memory.saved_bytes` of the same layer (`planner.model.build_layer`, autocast
per op). Step time is the median of a few forward + backward passes.

    python benchmarks/recompute.py [--dim 384 --layers 6 --seq 512 --mbs 2 --repeats 3]

Prints a table and writes benchmarks/results/recompute.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from hyperloom.config import load_config
from hyperloom.models.registry import build_model, family
from hyperloom.parallel.parallelize import materialize, select_ops
from hyperloom.parallel.recompute import apply_recompute
from hyperloom.planner import ModelSpec
from hyperloom.planner.memory import saved_bytes
from hyperloom.planner.model import build_layer

POLICIES = ["none", "norm", "core_attn", "mlp_act", "selective", "core_attn,mlp_act,norm", "full"]
DEFAULT_JSON = Path(__file__).parent / "results" / "recompute.json"


def measure(cfg, policy: str, mbs: int, seq: int, repeats: int) -> dict[str, float]:
    model = build_model(cfg.model)
    apply_recompute(model, policy, 0, family(cfg.model.family).recompute_plan(cfg.model))
    materialize(model, torch.device("cpu"), cfg.train.seed)
    select_ops(model, cfg)
    model.train()
    inside = [False]
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0]:
            saved[t.untyped_storage()._cdata] = t
        return t

    def enter(_m, args):
        inside[0] = True
        if policy == "full":  # the checkpoint keeps the block's input
            saved[args[0].untyped_storage()._cdata] = args[0]

    def leave(_m, _args, _out):
        inside[0] = False

    for block in model.layers.values():
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    tokens = torch.randint(0, cfg.model.vocab_size, (mbs, seq), generator=torch.Generator())
    times = []
    for i in range(repeats + 1):
        saved.clear()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens, labels=tokens)
        kept = sum(t.untyped_storage().nbytes() for t in saved.values())
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i:  # the first pass compiles the fused kernels
            times.append(time.perf_counter() - start)
    return {"saved_per_block": kept / cfg.model.n_layers, "step_s": statistics.median(times)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    overrides = ["--model.dim", str(args.dim), "--model.n_layers", str(args.layers)]
    overrides += ["--data.seq_len", str(args.seq), "--logging.run_dir", tempfile.mkdtemp()]
    cfg = load_config(None, overrides)
    layer = build_layer(ModelSpec.from_model_config(cfg.model), args.mbs, args.seq, 1, 1, False,
                        per_op_casts=True)  # fmt: skip
    rows = []
    for policy in POLICIES:
        got = measure(cfg, policy, args.mbs, args.seq, args.repeats)
        predicted = saved_bytes(layer, policy)
        rows.append({"policy": policy, **got, "planner_saved_per_block": predicted})
        err = got["saved_per_block"] / predicted - 1
        print(f"{policy}: measured {got['saved_per_block'] / 2**20:.2f} MiB per block, "
              f"planner {predicted / 2**20:.2f} MiB ({err:+.1%}), step {got['step_s']:.3f} s")  # fmt: skip
    table = Table(title=f"recompute: dim {args.dim}, {args.mbs} x {args.seq} tokens, BF16 autocast")
    for col in ("policy", "saved / block MiB", "planner MiB", "error", "step s"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        m, q = r["saved_per_block"], r["planner_saved_per_block"]
        table.add_row(r["policy"], f"{m / 2**20:.2f}", f"{q / 2**20:.2f}", f"{m / q - 1:+.1%}",
                      f"{r['step_s']:.3f}")  # fmt: skip
    Console().print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
