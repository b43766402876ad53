"""torchrun worker (4 ranks): sharded (DCP) checkpoints written at tp2 x dp2 load anywhere.

Trainer A (tp 2 x dp 2, ZeRO-1, `checkpoint.format = "sharded"`, asynchronous saves) trains
4 steps and checkpoints at steps 2 and 4: every rank writes its own shards. Its whole-tensor
state (what the whole format would hold: `full_model_state`, `full_optimizer_state`) is the
reference, written by rank 0 to OUT/reference.pt. Trainers of other layouts (dp 4 under FSDP2
and ZeRO-1, tp 2 x dp 2 under FSDP2, pp 2 x tp 2) load the step-4 checkpoint, which DCP
reshards into their layout, and gather their whole state again. Two of them then save in
their own layout (FSDP2 DTensors, FSDP2 x tp) and a third layout loads that: the way back.
Then the same for expert parallelism: a small MoE trained 2 steps at dp 4 x ep 2 (each rank holds
half of the experts) loads at ep 4 and ep 1. Rank 0 writes the names of the tensors that differ
to OUT/report.json. The caller loads the step-4 checkpoint in one process (no process group)
on its own.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest.tiny_job

from conftest import tiny_job  # noqa: E402

from hyperloom.checkpoint.state import full_model_state, full_optimizer_state  # noqa: E402
from hyperloom.config import load_config  # noqa: E402
from hyperloom.parallel.mesh import exit_worker  # noqa: E402
from hyperloom.train.trainer import Trainer  # noqa: E402

COMMON = dict(
    train__steps=4,
    checkpoint__every=2,
    checkpoint__keep=3,
    checkpoint__format="sharded",
    checkpoint__async_save=True,
)


DP4_ZERO1 = ("dp4_zero1", dict(parallel__dp=4, parallel__zero=1))
TP2_DP2_ZERO1 = ("tp2_dp2_zero1", dict(parallel__tp=2, parallel__dp=2, parallel__zero=1))
LAYOUTS = [  # (name, layout, None or the layout that loads what this one saves)
    ("dp4_fsdp", dict(parallel__dp=4, parallel__zero=3), TP2_DP2_ZERO1),
    (*DP4_ZERO1, None),
    ("tp2_dp2_fsdp", dict(parallel__tp=2, parallel__dp=2, parallel__zero=3), DP4_ZERO1),
    ("pp2_tp2", dict(parallel__pp=2, parallel__tp=2), DP4_ZERO1),
]


MOE = dict(
    model__family="deepseek",
    model__n_layers=3,
    model__n_heads=2,
    model__n_kv_heads=2,
    model__ffn_dim=96,
    model__n_dense_layers=1,
    model__n_routed_experts=8,
    model__moe_top_k=2,
    model__moe_ffn_dim=32,
    model__q_lora_rank=32,
    model__kv_lora_rank=24,
    model__qk_nope_head_dim=16,
    model__qk_rope_head_dim=8,
    model__v_head_dim=16,
    model__moe_bias_rate=0.01,
    parallel__dp=4,
    train__steps=2,
    train__eval_batches=1,
)
EP_LAYOUTS = [("ep4", dict(parallel__ep=4)), ("ep1", dict(parallel__ep=1))]


def trainer(run_dir: Path, **layout) -> Trainer:
    run_dir.mkdir(parents=True, exist_ok=True)  # Trainer.run() would; some only load/save
    args = tiny_job(run_dir, **{**COMMON, **layout})
    return Trainer(load_config(None, args, world_size=4))


def whole(t: Trainer) -> dict[str, torch.Tensor]:
    """Model and optimizer state, flattened to name -> whole tensor (a collective)."""
    out = {f"model/{k}": v for k, v in full_model_state(t.pm).items()}
    for name, entry in full_optimizer_state(t.pm, t.optimizer)["state"].items():
        out.update({f"optimizer/{name}/{k}": v for k, v in entry.items()})
    return out


def main() -> None:
    out = Path(sys.argv[1])
    run = out / "run"
    a = trainer(run, parallel__tp=2, parallel__dp=2, parallel__zero=1)
    a.run()
    reference = whole(a)
    stall = a.guard.writer.stall_s
    report: dict = {"tensors": len(reference), "stall_s": stall}

    def check(name: str, t: Trainer, path: Path, reference: dict = reference) -> None:
        start = time.perf_counter()
        t.load_checkpoint(path)
        report[f"load_s_{name}"] = time.perf_counter() - start
        got = whole(t)
        report[f"step_{name}"] = t.step
        report[f"same_names_{name}"] = sorted(got) == sorted(reference)
        report[f"differ_{name}"] = sorted(
            k for k in reference if k in got and not torch.equal(reference[k], got[k])
        )

    step4 = run / "checkpoints" / "step_00000004"
    for name, layout, back in LAYOUTS:
        t = trainer(out / name, **layout)
        check(name, t, step4)
        if back is not None:  # save in this layout, load in another
            saved = t.save(None, wait=True)
            check(f"{name}_to_{back[0]}", trainer(out / f"{name}-back", **back[1]), saved)

    moe = trainer(out / "ep2", **MOE, parallel__ep=2)
    moe.run()
    moe_reference = whole(moe)
    report["moe_tensors"] = len(moe_reference)
    step2 = out / "ep2" / "checkpoints" / "step_00000002"
    for name, layout in EP_LAYOUTS:
        check(f"moe_{name}", trainer(out / name, **MOE, **layout), step2, moe_reference)
    if dist.get_rank() == 0:
        torch.save(reference, out / "reference.pt")
        (out / "report.json").write_text(json.dumps(report, indent=1))
    exit_worker(0)


if __name__ == "__main__":
    main()
