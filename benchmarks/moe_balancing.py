"""Expert-load curves with and without auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2).

Trains the same small MoE model (one dense + two MoE layers of 16 experts, top-2 sigmoid
routing, no balance loss) twice from the same seed on the same batches of the built-in corpus
(Python's standard library, 2 MB of it, the built-in 16k tokenizer): once
with the selection bias frozen at zero, once moving it by ±gamma after every optimizer step
(`DeepSeekV3.after_optimizer_step`). Each step records every MoE layer's max/mean tokens per
expert (1.0 is a perfect balance). Writes the curves to JSON and a plot.

    python benchmarks/moe_balancing.py                     # 200 steps, gamma 0.003
    python benchmarks/moe_balancing.py --steps 500 --gamma 0.001 --lr 1e-3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from hyperloom.config import DataConfig, preset_config
from hyperloom.data import ResumableLoader, build_data
from hyperloom.engine.ops import OpImpls
from hyperloom.models.registry import init_model

RESULTS = Path(__file__).resolve().parent / "results"


def config(gamma: float):
    return dataclasses.replace(
        preset_config("moe-tiny"),
        dim=64,
        n_layers=3,
        n_dense_layers=1,
        n_heads=2,
        n_kv_heads=2,
        moe_ffn_dim=32,
        moe_n_groups=1,
        moe_topk_groups=1,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        mtp_depth=0,
        max_seq_len=64,
        moe_bias_rate=gamma,
        moe_seq_aux_alpha=0.0,
    )


def run(gamma: float, steps: int, lr: float, seed: int, data) -> dict[str, list[float]]:
    torch.manual_seed(seed)
    cfg = config(gamma)
    loader = ResumableLoader(data.train, 8, 64, seed=seed)
    model = init_model(cfg, "cpu", seed).use_ops(OpImpls.choose(compile=False)).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    curves: dict[str, list[float]] = {}
    for _ in range(steps):
        inputs, labels = loader.next_batch()  # (8, 64) each
        model(inputs, labels=labels).backward()
        opt.step()
        opt.zero_grad()
        for layer, ratio in model.after_optimizer_step().items():
            curves.setdefault(layer, []).append(ratio)
    return curves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--gamma", type=float, default=0.003)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=RESULTS / "moe_balancing.json")
    ap.add_argument("--plot", type=Path, default=RESULTS / "moe_balancing.png")
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = build_data(DataConfig(max_corpus_mb=2.0), preset_config("moe-tiny").vocab_size)
    start = time.perf_counter()
    out = {"steps": args.steps, "gamma": args.gamma, "lr": args.lr, "seed": args.seed, "runs": {}}
    for name, gamma in (("no_bias", 0.0), ("aux_loss_free", args.gamma)):
        curves = run(gamma, args.steps, args.lr, args.seed, data)
        tail = max(1, args.steps // 2)
        summary = {layer: sum(c[-tail:]) / tail for layer, c in curves.items()}
        out["runs"][name] = {"curves": curves, "mean_max_over_mean_last_half": summary}
    out["seconds"] = time.perf_counter() - start
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"{'run':<16}{'layer':<12}max/mean load, mean over the last half")
    for name, run_out in out["runs"].items():
        for layer, value in run_out["mean_max_over_mean_last_half"].items():
            print(f"{name:<16}{layer:<12}{value:.3f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (name, run_out), style in zip(out["runs"].items(), ("--", "-"), strict=True):
        for layer, curve in run_out["curves"].items():
            ax.plot(range(1, len(curve) + 1), curve, style, label=f"{name} {layer}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("max / mean tokens per expert")
    ax.set_title(f"Aux-loss-free balancing (gamma {args.gamma}) vs none, lr {args.lr}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.json} and {args.plot} in {out['seconds']:.1f} s")


if __name__ == "__main__":
    main()
