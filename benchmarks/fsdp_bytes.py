"""Bytes FSDP2 moves per step and rank: FP32 or BF16 gathers, FP32 or BF16 reduction, HSDP.

Each layout trains a small Llama (BF16 autocast, the precision a real job runs) for a few
steps in one torchrun launch on CPU (gloo), and every collective a step issues is counted by
wrapping `torch.distributed`'s all-gather, reduce-scatter and all-reduce entry points, which
FSDP2 calls through the module (`count_collectives`). A count is the collective's whole
buffer: an all-gather's output (the unsharded parameters), a reduce-scatter's input (the
unsharded gradients), an all-reduce's tensor; a ring sends (n-1)/n of it per rank, twice for
an all-reduce. All-gathers and reduce-scatters are those over the shard group (dp x cp, or
HSDP's dp_shard), all-reduces those over HSDP's replicas; the rest (scalars: the gradient
norm's sum, the guard's health check) is "other".

What a step of one micro-batch should move, with P_b the transformer blocks' parameters, P_r
the root's (embeddings, final norm, head), w and r the param and reduce widths in bytes, S
the shard group's size (`expected_bytes`):

    all-gather      w (2 P_b + P_r)    each block forward and again backward; the root once
                                       (FSDP2 keeps the root gathered into backward)
    reduce-scatter  r (P_b + P_r)
    all-reduce      r (P_b + P_r) / S  HSDP only: the shards, across the replicas

and, where the planner costs the layout (not HSDP), its per-layer gathers
(`costs.zero3_gather_groups` x `Runtime.param_gather_bytes`, forward and backward) and its
gradient reduce-scatter (`Runtime.grad_reduce_bytes` per parameter) must match the measured
ones: the planner leaves out the root's gather (`planner_bytes`). Losses are compared with a
one-process run in the same precision.dtype, the largest relative difference over the steps.

    python benchmarks/fsdp_bytes.py --json benchmarks/results/fsdp_bytes.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

WORLD = 4
LAYOUTS = {  # name -> [parallel] overrides at world 4
    "fsdp dp4": {"zero": 3, "dp": 4},
    "fsdp dp4 bf16-gather": {"zero": 3, "dp": 4, "fsdp_param_dtype": "bf16"},
    "fsdp dp4 bf16-gather bf16-reduce": {
        "zero": 3,
        "dp": 4,
        "fsdp_param_dtype": "bf16",
        "fsdp_reduce_dtype": "bf16",
    },
    "hsdp 2x2": {"zero": 3, "dp": 4, "dp_replicate": 2},
    "hsdp 2x2 bf16-gather": {"zero": 3, "dp": 4, "dp_replicate": 2, "fsdp_param_dtype": "bf16"},
}
COLUMNS = ("all_gather", "reduce_scatter", "all_reduce", "other")

# torch.distributed entry point -> the collective it is (names absent from a torch are skipped)
_ENTRY_POINTS = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
}


@contextlib.contextmanager
def count_collectives(groups: dict[str, object]):
    """Inside: the bytes of each all-gather, reduce-scatter and all-reduce issued through
    `torch.distributed`, summed by "kind@group" (the group's name in `groups`, else "other");
    yields the Counter."""
    import torch.distributed as dist

    counts: collections.Counter = collections.Counter()
    names = {id(g): n for n, g in groups.items() if g is not None}
    saved = {n: getattr(dist, n) for n in _ENTRY_POINTS if hasattr(dist, n)}

    def counted(name: str, fn):
        sig = inspect.signature(fn)

        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs).arguments
            size = max(
                (t.numel() * t.element_size() for t in bound.values() if torch.is_tensor(t)),
                default=0,
            )
            group = names.get(id(bound.get("group")), "other")
            counts[f"{_ENTRY_POINTS[name]}@{group}"] += size
            return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def columns(counts: dict[str, int]) -> dict[str, int]:
    """A step's counts as the table's columns: gathers and reduce-scatters over the shard
    group, all-reduces over the replicas, the rest as "other"."""
    out = dict.fromkeys(COLUMNS, 0)
    for key, n in counts.items():
        kind, group = key.split("@")
        mine = {
            "all_gather": "dp_shard",
            "reduce_scatter": "dp_shard",
            "all_reduce": "dp_replicate",
        }
        out[kind if group == mine[kind] else "other"] += n
    return out


def expected_bytes(job, block_params: int, root_params: int) -> dict[str, float]:
    """The module docstring's formulas for one micro-batch's step."""
    par = job.parallel
    w, r = (2 if d == "bf16" else 4 for d in (par.fsdp_param_dtype, par.fsdp_reduce_dtype))
    total = block_params + root_params
    shard = par.dp * par.cp // par.dp_replicate
    return {
        "all_gather": w * (2 * block_params + root_params),
        "reduce_scatter": r * total,
        "all_reduce": r * total / shard if par.dp_replicate > 1 else 0,
    }


def planner_bytes(job) -> dict[str, float] | None:
    """The planner's FSDP2 bytes for one micro-batch's step of `job` (tp = 1): the blocks'
    gathers forward and backward and the gradients' reduce-scatter; None under HSDP, which
    the planner does not cost."""
    from hyperloom.planner.costs import zero3_gather_groups
    from hyperloom.planner.model import ModelSpec
    from hyperloom.planner.strategy import Runtime, Strategy

    if job.parallel.dp_replicate > 1:
        return None
    spec, s, rt = ModelSpec.from_job(job), Strategy.from_job(job), Runtime.from_job(job)
    layer = sum(rt.param_gather_bytes * p for p, _, _ in zero3_gather_groups(spec, s))
    return {
        "all_gather_blocks": 2 * spec.n_layers * layer,
        "reduce_scatter": rt.grad_reduce_bytes * spec.params(),
    }


def planner_matches(r: dict) -> bool | None:
    """Whether a `measure` record's bytes are the planner's, the root's gather apart; None
    where the planner does not cost the layout."""
    plan = r["planner"]
    if plan is None:
        return None
    w = 2 if r["parallel"].get("fsdp_param_dtype") == "bf16" else 4
    blocks = r["bytes"]["all_gather"] - w * r["root_params"]
    return math.isclose(plan["all_gather_blocks"], blocks, rel_tol=1e-12) and math.isclose(
        plan["reduce_scatter"], r["bytes"]["reduce_scatter"], rel_tol=1e-12
    )


def job_args(a: argparse.Namespace) -> list[str]:
    """The model and run every layout shares (the global batch stays `a.batch` rows)."""
    values = {
        "model.dim": a.dim,
        "model.n_layers": a.layers,
        "model.n_heads": 8,
        "model.n_kv_heads": 4,
        "model.ffn_dim": 2 * a.dim,
        "model.vocab_size": 512,
        "model.max_seq_len": a.seq_len,
        "data.seq_len": a.seq_len,
        "data.max_corpus_mb": 0.5,
        "data.val_fraction": 0.2,
        "train.steps": a.steps,
        "train.warmup_steps": 1,
        "train.lr": 3e-3,
        "train.eval_every": 0,
        "train.eval_batches": 1,
        "train.device": "cpu",
        "precision.dtype": a.dtype,
        "logging.progress": "false",
        "logging.plot": "false",
        "logging.self_check": "off",
    }
    return [x for k, v in values.items() for x in (f"--{k}", str(v))]


def parallel_args(layout: dict, batch: int) -> list[str]:
    rows = batch // layout.get("dp", 1)
    args = [x for k, v in layout.items() for x in (f"--parallel.{k}", str(v))]
    return [*args, "--train.micro_batch_size", str(rows)]


def worker(spec_path: str) -> None:
    """Every case of the spec under torchrun (or one plain process): `steps` steps each, the
    collectives of each counted; rank 0 writes losses, gradient norms and counts."""
    import torch.distributed as dist

    from hyperloom.config import load_config
    from hyperloom.parallel.mesh import exit_worker
    from hyperloom.train.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = {}
    for name, args in spec["cases"].items():
        args = [*args, "--logging.run_dir", str(Path(spec["out"]).parent / "run")]
        trainer = Trainer(load_config(None, args, world_size=world))
        groups = {d: trainer.mesh.group(d) for d in ("dp_shard", "dp_replicate")}
        steps = []
        for _ in range(spec["steps"]):
            with count_collectives(groups) as counts:
                loss, norm = trainer.train_step()
            everyone = trainer._per_rank(dict(counts))
            if any(c != everyone[0] for c in everyone):
                raise RuntimeError(f"{name}: ranks moved different bytes: {everyone}")
            steps.append(
                {"loss": float(trainer.dp_mean(loss)), "grad_norm": float(norm), "bytes": counts}
            )
        blocks = sum(p.numel() for p in trainer.model.layers.parameters())
        total = sum(p.numel() for p in trainer.model.parameters())
        out[name] = {"steps": steps, "block_params": blocks, "root_params": total - blocks}
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(out))
    sys.exit(exit_worker(0))


def launch(world: int, cases: dict[str, list[str]], steps: int, tmp: Path) -> dict:
    """Run `cases` (name -> job args) in one launch of `world` processes; their records."""
    out, spec = tmp / f"w{world}.json", tmp / f"w{world}_spec.json"
    spec.write_text(json.dumps({"cases": cases, "steps": steps, "out": str(out)}))
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd = [sys.executable, *(torchrun if world > 1 else []), __file__, "--worker", str(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise RuntimeError(f"world {world} failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def measure(a: argparse.Namespace, names: list[str], tmp: Path) -> dict:
    """Each named layout beside the one-process run: bytes per step (the first step's; every
    step moves the same), the formulas', the planner's and the largest loss difference."""
    from hyperloom.config import load_config

    base = job_args(a)
    cases = {n: base + parallel_args(LAYOUTS[n], a.batch) for n in names}
    runs = launch(WORLD, cases, a.steps, tmp)
    ref = launch(1, {"one process": base + parallel_args({}, a.batch)}, a.steps, tmp)
    ref_losses = [s["loss"] for s in ref["one process"]["steps"]]
    results = {}
    for name in names:
        run = runs[name]
        job = load_config(None, cases[name], world_size=WORLD)
        losses = [s["loss"] for s in run["steps"]]
        results[name] = {
            "parallel": LAYOUTS[name],
            "bytes": columns(run["steps"][0]["bytes"]),
            "per_step": [s["bytes"] for s in run["steps"]],
            "expected": expected_bytes(job, run["block_params"], run["root_params"]),
            "planner": planner_bytes(job),
            "root_params": run["root_params"],
            "losses": losses,
            "grad_norms": [s["grad_norm"] for s in run["steps"]],
            "max_rel_loss_diff": max(
                abs(x - y) / abs(y) for x, y in zip(losses, ref_losses, strict=True)
            ),
        }
    return {"reference_losses": ref_losses, "layouts": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--only", default=",".join(LAYOUTS), help="comma-separated layout names")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="precision.dtype")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    if a.worker:
        worker(a.worker)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    import machine

    names = a.only.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        got = measure(a, names, Path(tmp))
    head = f"{'layout':32} {'all-gather B':>12} {'reduce-scatter B':>16} {'all-reduce B':>12}"
    print(head + f" {'other B':>7} {'formula':>7} {'planner':>7} {'loss diff':>9}")
    ok, word = True, {True: "yes", False: "NO", None: "-"}
    for name, r in got["layouts"].items():
        b, want = r["bytes"], r["expected"]
        formula = all(b[k] == want[k] for k in want)
        agrees = planner_matches(r)
        ok &= formula and agrees is not False
        print(
            f"{name:32} {b['all_gather']:12,} {b['reduce_scatter']:16,} {b['all_reduce']:12,} "
            f"{b['other']:7,} {word[formula]:>7} {word[agrees]:>7} {r['max_rel_loss_diff']:9.1e}"
        )
    if a.json:
        payload = {
            "machine": machine.machine_info(threads=0, device="cpu"),
            "revision": machine.hyperloom_revision(),
            "config": vars(a),
            "results": got,
        }
        machine.write_results(a.json, payload)
        print(f"wrote {a.json}")
    if not ok:
        raise SystemExit("measured bytes differ from the formulas or the planner's")


if __name__ == "__main__":
    main()
