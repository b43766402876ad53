"""torchrun worker: train several parallel layouts in one launch, each with the real Trainer.

Usage: torchrun --nproc-per-node N layouts_worker.py OUT_DIR CASE [CASE ...] -- JOB_ARGS...
with each CASE `tp:dp:sp:zero` and JOB_ARGS the `--section.key value` overrides of the job.
Case `c` trains into OUT_DIR/c exactly as `hyperloom train --nproc N JOB_ARGS` with the case's
layout would (same config loading, same Trainer), but the N interpreters, torch imports and the
process group are paid once for all cases instead of once per case.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from hyperloom.config import load_config
from hyperloom.parallel.mesh import exit_worker
from hyperloom.train.trainer import Trainer


def main() -> None:
    split = sys.argv.index("--")
    out, cases, job = Path(sys.argv[1]), sys.argv[2:split], sys.argv[split + 1 :]
    world = int(os.environ["WORLD_SIZE"])
    global_batch = int(os.environ.get("LAYOUTS_GLOBAL_BATCH", "8"))
    for case in cases:
        tp, dp, sp, zero = (int(v) for v in case.split(":"))
        layout = [
            "--parallel.tp", str(tp),
            "--parallel.dp", str(dp),
            "--parallel.sp", "true" if sp else "false",
            "--parallel.zero", str(zero),
            "--train.micro_batch_size", str(global_batch // dp),
            "--logging.run_dir", str(out / case.replace(":", "-")),
        ]  # fmt: skip
        try:
            Trainer(load_config(None, job + layout, world_size=world)).run()
        except Exception:
            traceback.print_exc()
            sys.stderr.write(f"rank {dist.get_rank()}: layout {case} failed\n")
            sys.stderr.flush()
            os._exit(1)  # torchrun stops the ranks that wait for this one
        dist.barrier()
    exit_worker(0)


if __name__ == "__main__":
    main()
