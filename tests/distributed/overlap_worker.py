"""Worker: the expert-parallel overlap changes no number, and really overlaps.

Usage: torchrun --nproc-per-node N overlap_worker.py OUT.json JOB.json

JOB.json is `{"job": [ARGS...], "cases": [[NAME, [ARGS...]], ...]}`. For each case the real
Trainer trains `STEPS` steps twice, with `parallel.ep_overlap` off and on, from the same
initial weights and batches. OUT.json gets, per case (from rank 0, everything gathered):

- `loss` / `norm`: the largest absolute difference of the losses and gradient norms;
- `weights`: the largest absolute difference of any parameter element after the steps, over
  every rank's parameters (equal weights after Adam steps need equal gradients);
- `pairs`: the overlapped pairs the last step ran, summed over ranks; `comm`: collectives
  waited inside a pair; `hidden`: those during which the other lane computed; `violations`:
  collectives whose in-flight time holds no compute span of the other lane although that
  lane was still running (each should hold one);
- `exposed_s` / `in_flight_s`: the all-to-all time the lanes sat waiting, and in flight.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from hyperloom.config import load_config
from hyperloom.parallel import overlap
from hyperloom.parallel.mesh import exit_worker
from hyperloom.train.trainer import Trainer

STEPS = 2


def _train(args: list[str], world: int) -> dict:
    trainer = Trainer(load_config(None, args, world_size=world))
    losses, norms = [], []
    for _ in range(STEPS):
        overlap.STATS.reset()
        loss, norm = trainer.train_step()
        losses.append(float(trainer.dp_mean(loss)))
        norms.append(float(norm))
    weights = {n: p.detach().clone() for n, p in trainer.pm.local_params()}
    ex = getattr(trainer.pm, "executor", None)
    duets = [] if ex is None else [d for _, d in ex.trace]
    if trainer.overlapped is not None:  # pp = 1: gradient accumulation's pairs
        duets = trainer.overlapped.trace
    return {
        "loss": losses,
        "norm": norms,
        "weights": weights,
        "duets": duets,
        "stats": (overlap.STATS.exposed_s, overlap.STATS.in_flight_s),
    }


def _check_trace(duets: list[overlap.Duet]) -> tuple[int, int, int]:
    """(collectives, hidden, violations) over the duets of one step (module docstring)."""
    comm = hidden = bad = 0
    for duet in duets:
        ends = {
            lane: max((s.end for s in duet.trace if s.lane == lane), default=0.0) for lane in (0, 1)
        }
        for span in duet.trace:
            if span.kind == "compute" or span.kind.endswith(":wait"):
                continue
            comm += 1
            other = 1 - span.lane
            overlapped = any(
                s.lane == other
                and s.kind == "compute"
                and s.start >= span.start
                and s.end <= span.end
                for s in duet.trace
            )
            hidden += overlapped
            if not overlapped and ends[other] > span.start:
                bad += 1
    return comm, hidden, bad


def main() -> None:
    out = Path(sys.argv[1])
    spec = json.loads(Path(sys.argv[2]).read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    report = {}
    for name, extra in spec["cases"]:
        try:
            base = [*spec["job"], *extra, "--logging.run_dir", str(out.parent / name)]
            off = _train([*base, "--parallel.ep_overlap", "false"], world)
            on = _train([*base, "--parallel.ep_overlap", "true"], world)
            diff = max(
                (off["weights"][n] - on["weights"][n]).abs().max().item() for n in off["weights"]
            )
            comm, hidden, bad = _check_trace(on["duets"])
            local = torch.tensor(
                [diff, len(on["duets"]), comm, hidden, bad, *on["stats"], *off["stats"]],
                dtype=torch.float64,
            )
            everyone = [torch.zeros_like(local) for _ in range(world)]
            dist.all_gather(everyone, local)
            rows = torch.stack(everyone)
            report[name] = {
                "loss": max(abs(a - b) for a, b in zip(off["loss"], on["loss"], strict=True)),
                "norm": max(abs(a - b) for a, b in zip(off["norm"], on["norm"], strict=True)),
                "ref_loss": off["loss"],
                "weights": rows[:, 0].max().item(),
                "pairs": int(rows[:, 1].sum()),
                "comm": int(rows[:, 2].sum()),
                "hidden": int(rows[:, 3].sum()),
                "violations": int(rows[:, 4].sum()),
                "exposed_s": rows[:, 5].sum().item(),
                "in_flight_s": rows[:, 6].sum().item(),
                "exposed_off_s": rows[:, 7].sum().item(),
            }
        except Exception:
            traceback.print_exc()
            sys.stderr.write(f"rank {dist.get_rank()}: case {name} failed\n")
            sys.stderr.flush()
            os._exit(1)
        dist.barrier()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(report, indent=1))
    sys.exit(exit_worker(0))


if __name__ == "__main__":
    main()
