"""FP8 gradient fidelity: how far each recipe's gradient is from FP32's, and which GEMM puts it there.

The convergence benchmark (`fp8_convergence.py`) answers "does FP8 train as well as BF16?" with
one number per 1000-step run, and the runs' spread is as large as the effect. This one asks the
step-level question on a trained checkpoint: on the same weights and the same batches, how far is
the gradient of each precision from the FP32 gradient, and how much of that comes from the
forward GEMM, the data-gradient GEMM and the weight-gradient GEMM? The split uses the recipes'
`override_linear_precision` (TransformerEngine's field): "fwd FP8" runs only the forward GEMM in
FP8 (dgrad and wgrad in BF16), "bwd FP8" only the two backward GEMMs.

Per contender it reports the relative L2 error of the whole gradient against FP32's,
||g - g_fp32|| / ||g_fp32|| summed over `--batches` fixed batches, and the same per parameter
group (attention q/k, v/o, feed-forward) and per layer; BF16 (the baseline's own rounding) and
BF16 with the reference operators (the same arithmetic rounded at other points) give the scale.
It also evaluates the checkpoint with each recipe's forward: what quantizing the forward does to
the validation loss itself, with the weights fixed; and, on the first validation batch, what it
does to attention: the logits' scale per layer in FP32 (a model whose logits have grown large
attends almost one-hot, and a few percent of rounding in q and k then moves which key wins) and
each forward's logit error, softmax distance and changed most-attended keys against FP32's.

    python benchmarks/fp8_gradient_fidelity.py                       # trains a 300-step BF16 checkpoint first
    python benchmarks/fp8_gradient_fidelity.py --checkpoint runs/x/checkpoints/step_00000750
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import machine
import torch
from rich.console import Console
from rich.table import Table

from hyperloom.checkpoint import checkpoint_step, latest_checkpoint
from hyperloom.config import load_config
from hyperloom.engine import ops
from hyperloom.engine.fp8 import fp8_autocast, recipe_from_name
from hyperloom.train.trainer import Trainer

RESULTS = Path(__file__).resolve().parent / "results"
# Not delayed scaling: its scales come from an amax history that a BF16 checkpoint lacks (and
# that one step cannot fill); from an empty history every tensor is cast with scale 1.
RECIPES = ("blockwise", "current", "rowwise", "mxfp8")
# Which GEMMs run in FP8: the recipe's override_linear_precision is the complement.
SPLITS = {
    "all FP8": (False, False, False),
    "fwd FP8": (False, True, True),
    "bwd FP8": (True, False, False),
}
GROUPS = {
    "attn q/k": (".wq.", ".wk."),
    "attn v/o": (".wv.", ".wo."),
    "ffn": ("feed_forward",),
}


def make_checkpoint(steps: int, threads: int, root: Path) -> Path:
    """A BF16 run of the default job for `steps` steps; its last checkpoint."""
    run_dir = root / "bf16"
    cmd = [
        sys.executable, "-m", "hyperloom", "train", "--run-dir", str(run_dir),
        "--train.steps", str(steps), "--train.eval_every", "0", "--checkpoint.every", "0",
        "--logging.progress", "false", "--logging.plot", "false", "--logging.sample_prompt", "",
        "--logging.self_check", "off", "--resilience.on_anomaly", "none",
    ]  # fmt: skip
    print(f"training a {steps}-step BF16 checkpoint in {run_dir} ...", flush=True)
    env = dict(os.environ) | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    subprocess.run(cmd, check=True, env=env)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise SystemExit(f"the BF16 run in {run_dir} left no checkpoint")
    return ckpt


def trainer_for(ckpt: Path, overrides: list[str]) -> Trainer:
    """A trainer of the checkpoint's own job (with `overrides`), holding its weights."""
    base = [
        "--logging.run_dir", str(Path(tempfile.gettempdir()) / "hyperloom_fp8_fidelity"),
        "--checkpoint.resume", "none", "--precision.fp8", "none", "--logging.self_check", "off",
    ]  # fmt: skip
    cfg = load_config(ckpt / "config.toml", base + overrides)
    trainer = Trainer(cfg)
    trainer.load_checkpoint(ckpt)
    return trainer


def gradients(trainer: Trainer, batches: int, recipe=None) -> tuple[list[dict], float]:
    """Per batch {name: FP32 gradient} of the validation batches, and their mean loss."""
    model, out, losses = trainer.model, [], []
    model.train()
    for inputs, labels in trainer.val[:batches]:
        model.zero_grad(set_to_none=True)
        with fp8_autocast(recipe) if recipe is not None else contextlib.nullcontext():
            with trainer.acc.autocast(trainer.dtype):
                loss = trainer.fwd(
                    inputs.to(trainer.acc.device), labels=labels.to(trainer.acc.device)
                )
            loss.backward()
        losses.append(loss.item())
        out.append({n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()})
    return out, sum(losses) / len(losses)


def rel_error(grads: list[dict], ref: list[dict], names: list[str]) -> float:
    err = sum(
        ((g[n] - r[n]).square().sum()).item()
        for g, r in zip(grads, ref, strict=True)
        for n in names
    )
    norm = sum((r[n].square().sum()).item() for r in ref for n in names)
    return (err / norm) ** 0.5 if norm > 0 else float("nan")


def breakdown(grads: list[dict], ref: list[dict]) -> dict[str, Any]:
    names = list(ref[0])
    layers = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
    return {
        "all": rel_error(grads, ref, names),
        "groups": {
            g: rel_error(grads, ref, [n for n in names if any(k in n for k in keys)])
            for g, keys in GROUPS.items()
        },
        "layers": {
            str(i): rel_error(grads, ref, [n for n in names if n.startswith(f"layers.{i}.")])
            for i in layers
        },
    }


def _flat(grad: dict, names: list[str]) -> torch.Tensor:
    return torch.cat([grad[n].flatten() for n in names])


def noise_or_bias(grads: list[dict], ref: list[dict]) -> dict[str, float]:
    """Is the error noise or bias? The mean cosine between the error vectors of different
    batches (about 0: independent per batch, averaged away over steps; towards 1: the same
    direction every batch), and the error's component along the mean FP32 gradient as a
    fraction of it (negative: the gradient comes out shorter along its true direction)."""
    names = list(ref[0])
    r = [_flat(x, names) for x in ref]
    e = [_flat(g, names) - x for g, x in zip(grads, r, strict=True)]
    mean = torch.stack(r).mean(0)
    cos = [
        torch.nn.functional.cosine_similarity(e[i], e[j], dim=0).item()
        for i in range(len(e))
        for j in range(i + 1, len(e))
    ]
    along = torch.dot(torch.stack(e).mean(0), mean) / mean.square().sum()
    return {"error_cosine_between_batches": sum(cos) / len(cos), "error_along_mean": along.item()}


def sampling_noise(ref: list[dict]) -> float:
    """How far one batch's FP32 gradient is from the mean over the batches, relative to the
    mean: the noise SGD already lives with, the scale for a precision's error."""
    names = list(ref[0])
    r = torch.stack([_flat(x, names) for x in ref])
    mean = r.mean(0)
    return ((r - mean).norm(dim=1).mean() / mean.norm()).item()


def attention_logits(trainer: Trainer, recipe=None) -> list[torch.Tensor]:
    """Per layer, the attention logits q kᵀ / sqrt(d) (b, heads, s, s; FP32, masked entries
    -inf) of the first validation batch, with q and k from the layer's own projections in this
    trainer's precision (FP8 GEMMs under `recipe`). Llama attention only (wq, wk, head_dim)."""
    model, out, hooks = trainer.model, [], []

    def grab(mod, args, _output):
        x, cos, sin = args[:3]
        q = mod.wq(x).unflatten(-1, (-1, mod.head_dim))
        k = mod.wk(x).unflatten(-1, (-1, mod.head_dim))
        if getattr(mod, "q_norm", None) is not None:  # model.qk_norm
            q, k = mod.q_norm(q), mod.k_norm(k)
        seq = q.shape[1]
        q = ops.rope(q, cos[:seq], sin[:seq], mod.ops.rope).float().transpose(1, 2)
        k = ops.rope(k, cos[:seq], sin[:seq], mod.ops.rope).float().transpose(1, 2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = q @ k.transpose(-1, -2) / mod.head_dim**0.5
        causal = torch.ones(seq, seq, dtype=torch.bool, device=s.device).tril()
        out.append(s.masked_fill(~causal, float("-inf")).cpu())

    for mod in model.modules():
        if all(hasattr(mod, a) for a in ("wq", "wk", "head_dim")):
            hooks.append(mod.register_forward_hook(grab))
    if not hooks:
        return []
    inputs, _ = trainer.val[0]
    model.eval()
    try:
        with (
            torch.no_grad(),
            fp8_autocast(recipe) if recipe is not None else contextlib.nullcontext(),
        ):
            with trainer.acc.autocast(trainer.dtype):
                trainer.fwd(inputs.to(trainer.acc.device))
    finally:
        for h in hooks:
            h.remove()
    return out


def logit_scale(ref: list[torch.Tensor]) -> list[dict[str, float]]:
    """Per layer, the largest |logit| and the logits' standard deviation (causal entries)."""
    rows = []
    for s in ref:
        v = s[torch.isfinite(s)]
        rows.append({"amax": v.abs().max().item(), "std": v.std().item()})
    return rows


def attention_shift(logits: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, Any]:
    """How far a precision's attention is from FP32's, per layer: the RMS logit error, the mean
    total-variation distance between the softmax rows (0: same weights, 1: disjoint), and the
    fraction of rows (query x head) whose most-attended key changes."""
    layers = []
    for s, r in zip(logits, ref, strict=True):
        ok = torch.isfinite(r)
        tv = 0.5 * (s.softmax(-1) - r.softmax(-1)).abs().sum(-1)
        layers.append({
            "logit_err_rms": (s[ok] - r[ok]).square().mean().sqrt().item(),
            "attn_tv": tv.mean().item(),
            "argmax_flips": (s.argmax(-1) != r.argmax(-1)).float().mean().item(),
        })  # fmt: skip
    mean = {k: sum(x[k] for x in layers) / len(layers) for k in layers[0]}
    return {"mean": mean, "layers": layers}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(results.items())
    layers = list(rows[0][1]["layers"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bases = list(dict.fromkeys(name.split(" ")[0] for name, _ in rows))
    colors = dict(zip(bases, plt.get_cmap("tab10").colors, strict=False))
    styles = {"all": "-", "fwd": "--", "bwd": ":"}  # which GEMMs run in FP8
    for name, r in rows:
        base, _, split = name.partition(" ")
        ax.plot(
            [int(i) for i in layers],
            [r["layers"][i] for i in layers],
            styles.get(split.split(" ")[0], "-"),
            color=colors[base],
            marker="o",
            ms=3,
            label=name,
        )
    ax.set_xlabel("layer")
    ax.set_ylabel("relative gradient error vs FP32")
    ax.set_yscale("log")
    ax.set_title("Gradient error per layer (same weights, same batches)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkpoint", type=Path, help="a trained checkpoint (default: train one)")
    ap.add_argument(
        "--train-steps",
        type=int,
        default=300,
        help="steps of the BF16 run made without --checkpoint",
    )
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument(
        "--batches", type=int, default=4, help="validation batches the gradients are summed over"
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path, default=RESULTS / "fp8_gradient_fidelity.json")
    ap.add_argument("--plot", type=Path, default=RESULTS / "fp8_gradient_fidelity.png")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    recipes = [r for r in args.recipes.split(",") if r]
    for r in recipes:
        if r not in RECIPES:
            raise SystemExit(f"unknown recipe {r!r}; known: {', '.join(RECIPES)}")
    ckpt = args.checkpoint or make_checkpoint(
        args.train_steps, args.threads, Path(tempfile.mkdtemp(prefix="fp8_fidelity_"))
    )
    if not (ckpt / "config.toml").exists():
        raise SystemExit(f"{ckpt} is not a hyperloom checkpoint (no config.toml in it)")

    contenders: list[tuple[str, list[str], Any]] = [
        ("fp32", ["--precision.dtype", "fp32"], None),
        ("bf16", [], None),
        ("bf16-refops", ["--ops.fused", "false"], None),
    ]
    for r in recipes:
        for split, override in SPLITS.items():
            recipe = dataclasses.replace(recipe_from_name(r), override_linear_precision=override)
            contenders.append((f"{r} {split}", ["--precision.fp8", r], recipe))
    grads: dict[str, list[dict]] = {}
    losses: dict[str, float] = {}
    val: dict[str, float] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    for i, (name, overrides, recipe) in enumerate(contenders, 1):
        t0 = time.perf_counter()
        trainer = trainer_for(ckpt, overrides)
        if args.batches > len(trainer.val):
            raise SystemExit(
                f"--batches {args.batches}: the job has {len(trainer.val)} validation batches"
            )
        grads[name], losses[name] = gradients(trainer, args.batches, recipe)
        if recipe is None or name.endswith("all FP8"):  # the forward alone decides these
            val[name.split(" ")[0]] = trainer.evaluate()
            logits[name.split(" ")[0]] = attention_logits(trainer, recipe)
        print(
            f"[{i}/{len(contenders)}] {name:<20} loss {losses[name]:.5f}  ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        del trainer

    ref = grads["fp32"]
    results = {
        name: breakdown(g, ref) | noise_or_bias(g, ref) | {"loss": losses[name]}
        for name, g in grads.items()
        if name != "fp32"
    }
    noise = sampling_noise(ref)
    step = checkpoint_step(ckpt)
    table = Table(
        title=f"Gradient error vs FP32 ({args.batches} batches, checkpoint step {step}); "
        f"one batch's gradient is {noise:.2f} of the mean away from the mean",
        caption="err cos: mean cosine between different batches' error vectors (0 = noise); "
        "along: the error's component along the mean FP32 gradient, as a fraction of it",
    )
    table.add_column("contender", no_wrap=True)
    table.add_column("all", justify="right")
    for g in GROUPS:
        table.add_column(g, justify="right")
    layers = list(results["bf16"]["layers"])
    table.add_column(f"layer {layers[0]}", justify="right")
    table.add_column(f"layer {layers[-1]}", justify="right")
    table.add_column("err cos", justify="right")
    table.add_column("along", justify="right")
    for name, r in results.items():
        table.add_row(
            name, f"{r['all']:.4f}", *(f"{r['groups'][g]:.4f}" for g in GROUPS),
            f"{r['layers'][layers[0]]:.4f}", f"{r['layers'][layers[-1]]:.4f}",
            f"{r['error_cosine_between_batches']:+.3f}", f"{r['error_along_mean']:+.4f}",
        )  # fmt: skip
    console = Console()
    if not console.is_terminal:  # a log file: no 80-column default that cuts the numbers
        console.width = 140
    console.print(table)
    base = val["bf16"]
    vt = Table(title="Validation loss of the same weights, forward in each precision")
    vt.add_column("forward")
    vt.add_column("val loss", justify="right")
    vt.add_column("vs BF16", justify="right")
    for name, v in val.items():
        vt.add_row(name, f"{v:.5f}", f"{(v - base) / base * 100:+.3f}%")
    console.print(vt)
    attention: dict[str, Any] = {}
    if logits["fp32"]:
        attention = {
            "fp32_logits": logit_scale(logits["fp32"]),
            "shift_vs_fp32": {
                n: attention_shift(v, logits["fp32"]) for n, v in logits.items() if n != "fp32"
            },
        }
        scale = ", ".join(
            f"{i}: {r['amax']:.0f} / {r['std']:.1f}" for i, r in enumerate(attention["fp32_logits"])
        )
        at = Table(
            title="Attention of the first validation batch, each forward against FP32's",
            caption=f"FP32 logits q·k/sqrt(d), largest |logit| / std per layer: {scale}",
        )
        for col in ("forward", "logit err (RMS)", "attn TV", "argmax flips", "TV per layer"):
            at.add_column(col, justify="left" if col == "forward" else "right")
        for name, sh in attention["shift_vs_fp32"].items():
            m = sh["mean"]
            at.add_row(
                name, f"{m['logit_err_rms']:.3f}", f"{m['attn_tv']:.4f}",
                f"{m['argmax_flips'] * 100:.2f}%",
                " ".join(f"{x['attn_tv']:.3f}" for x in sh["layers"]),
            )  # fmt: skip
        console.print(at)

    payload = {
        "benchmark": "fp8_gradient_fidelity",
        "checkpoint_step": step,
        "checkpoint_run": ckpt.parent.parent.name,
        "batches": args.batches,
        "splits": {k: {"override_linear_precision": v} for k, v in SPLITS.items()},
        "machine": machine.machine_info(torch.get_num_threads(), "cpu"),
        "sampling_noise": noise,
        "gradient_error_vs_fp32": results,
        "val_loss_by_forward": val,
        "attention": attention,
        "wall_time_s": time.perf_counter() - t_start,
    }
    machine.write_results(args.json, payload)
    plot(results, args.plot)
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
