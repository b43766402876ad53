"""torchrun worker (4 ranks): sharded checkpoints of experts split over ep and etp reshard.

Trainer A (the small MoE of `sharded_checkpoint_worker` with 4 heads, for tp 4; tp 2 x etp 2
x dp 2 x ep 2, ZeRO-1, `checkpoint.format = "sharded"`) trains 2 steps and saves: each rank
writes its quarter of every routed expert weight (half the experts, half their hidden
width), which DCP records at its offsets in the whole tensor. Its whole-tensor state (what
the whole format holds) is the reference. Other layouts load that checkpoint and must hold
the reference bitwise: etp 1 (experts whole over tp), ep 1, tp 4 x etp 2 (two copies of each
slice), dp 4 x ep 4 without tp, FSDP2 with ep 1 (the etp slices sharded over dp) and with
ep 2; four of them save in their own layout and A's layout (or FSDP2's) loads that back.
Then a checkpoint one process saved (the caller's ONE_PROCESS_RUN) loads at A's layout.
Rank 0 writes OUT/report.json and OUT/reference.pt.

Usage: torchrun --nproc-per-node 4 etp_layouts_worker.py OUT [ONE_PROCESS_RUN]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from sharded_checkpoint_worker import MOE, trainer, whole

from hyperloom.parallel.mesh import exit_worker

HEADS = {"model__n_heads": 4, "model__n_kv_heads": 4}  # so that tp 4 splits them
MOE_ETP = {**MOE, **HEADS, "parallel__dp": 2, "parallel__tp": 2}
A = dict(parallel__etp=2, parallel__ep=2, parallel__zero=1)
FSDP = dict(parallel__etp=2, parallel__zero=3)
# name: (layout, None or (name, layout) of the layout that loads what this one saves)
LAYOUTS = {
    "etp1": (dict(parallel__ep=2, parallel__zero=1), ("a", A)),
    "ep1": (dict(parallel__etp=2), None),
    # two etp groups per tp group hold the same slices: DCP writes one copy
    "tp4_etp2": (dict(parallel__tp=4, parallel__dp=1, parallel__etp=2), ("a", A)),
    "dp4_ep4": (
        dict(parallel__tp=1, parallel__dp=4, parallel__ep=4, parallel__zero=1),
        ("fsdp", FSDP),
    ),
    "fsdp": (FSDP, ("a", A)),
    "fsdp_ep2": (dict(parallel__etp=2, parallel__ep=2, parallel__zero=3), None),
}


def main() -> None:
    out = Path(sys.argv[1])
    a = trainer(out / "a", **{**MOE_ETP, **A})
    a.run()
    reference = whole(a)
    report: dict = {"tensors": len(reference)}

    def check(name: str, layout: dict, path: Path, reference: dict = reference):
        t = trainer(out / name, **{**MOE_ETP, **layout})
        t.load_checkpoint(path)
        got = whole(t)
        report[f"step_{name}"] = t.step
        report[f"same_names_{name}"] = sorted(got) == sorted(reference)
        report[f"differ_{name}"] = sorted(
            k for k in reference if k not in got or not torch.equal(reference[k], got[k])
        )
        return t

    step2 = out / "a" / "checkpoints" / "step_00000002"
    for name, (layout, back) in LAYOUTS.items():
        t = check(name, layout, step2)
        if back is not None:  # save in this layout, load in another
            saved = t.save(None, wait=True)
            check(f"{name}_to_{back[0]}", back[1], saved)
    if len(sys.argv) > 2:  # a one-process run's checkpoint at A's layout
        one = Path(sys.argv[2])
        want = torch.load(one / "reference.pt")
        check("one_process_to_a", A, one / "checkpoints" / "step_00000002", want)
    if dist.get_rank() == 0:
        torch.save(reference, out / "reference.pt")
        (out / "report.json").write_text(json.dumps(report, indent=1))
    exit_worker(0)


if __name__ == "__main__":
    main()
