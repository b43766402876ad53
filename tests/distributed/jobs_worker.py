"""Worker: train several jobs in one launch, each with the real Trainer.

Usage: torchrun --nproc-per-node N jobs_worker.py SPEC.json   (or plain `python` for one process)

SPEC.json is `{"out": DIR, "job": [ARGS...], "cases": [[NAME, [ARGS...]], ...]}`: case NAME
trains into DIR/NAME exactly as `hyperloom train --nproc N JOB_ARGS CASE_ARGS` would (same
config loading, same Trainer), but the N interpreters, torch imports and the process group are
paid once for all cases instead of once per case. Cases run in order, so two cases of one NAME
are a run and its resumption (the first with `--train.stop_at_step`). Outside torchrun
(WORLD_SIZE unset) no process group is made, as the CLI does for `--nproc 1`. With
`"shapes": true` in SPEC.json each rank also writes DIR/NAME/shapes_rank{R}.json after a
case: its parameters' local shapes and `Shard` records, by name.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from hyperloom.config import load_config
from hyperloom.parallel.mesh import exit_worker
from hyperloom.train.trainer import Trainer


def write_shapes(trainer: Trainer, run_dir: Path) -> None:
    from dataclasses import asdict

    from hyperloom.models.shard import shard_of

    rank = dist.get_rank() if dist.is_initialized() else 0
    shapes = {}
    for name, p in trainer.pm.local_params():
        shard = shard_of(p)
        shapes[name] = {"shape": list(p.shape), "shard": None if shard is None else asdict(shard)}
    (run_dir / f"shapes_rank{rank}.json").write_text(json.dumps(shapes))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out, job = Path(spec["out"]), list(spec["job"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for name, extra in spec["cases"]:
        args = [*job, *extra, "--logging.run_dir", str(out / name)]
        try:
            trainer = Trainer(load_config(None, args, world_size=world))
            trainer.run()
            if spec.get("shapes"):
                write_shapes(trainer, out / name)
        except Exception:
            traceback.print_exc()
            rank = dist.get_rank() if dist.is_initialized() else 0
            sys.stderr.write(f"rank {rank}: case {name} failed\n")
            sys.stderr.flush()
            os._exit(1)  # torchrun stops the ranks that wait for this one
        if dist.is_initialized():
            dist.barrier()
    sys.exit(exit_worker(0))


if __name__ == "__main__":
    main()
