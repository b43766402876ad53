"""Worker: the activation bytes one training forward saves for backward on each rank.

Usage: torchrun --nproc-per-node N context_memory_worker.py OUT.json ARGS...   (or python)

Builds the job's Trainer (ARGS are `hyperloom train` overrides), takes this rank's part of a
training batch and runs one forward with the loss under `saved_tensors_hooks`, counting each
saved storage once and leaving out the parameters (they are weights, not activations). Rank 0
writes every rank's bytes.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from hyperloom.config import load_config
from hyperloom.parallel.footprint import saved_activations
from hyperloom.parallel.mesh import exit_worker
from hyperloom.train.trainer import Trainer


def saved_activation_bytes(trainer: Trainer) -> int:
    inputs, labels = trainer._local_batch()
    trainer.pm.module.train()
    with saved_activations(trainer.model) as seen:
        loss = trainer.fwd(inputs, labels=labels)
    loss.backward()  # the ring's collectives in backward run on every rank alike
    return sum(seen.values())


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    trainer = Trainer(load_config(None, args, world_size=int(os.environ.get("WORLD_SIZE", "1"))))
    mine = saved_activation_bytes(trainer)
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(ranks, f)
    sys.exit(exit_worker(0))


if __name__ == "__main__":
    main()
