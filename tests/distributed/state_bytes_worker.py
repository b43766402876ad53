"""Run under torchrun: one training step of a layout, then write this rank's state bytes.

Usage: torchrun --nproc-per-node N state_bytes_worker.py OUT_DIR --parallel.tp 2 ...
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from hyperloom.config import load_config
from hyperloom.parallel.footprint import local_state_bytes
from hyperloom.parallel.mesh import exit_worker
from hyperloom.train.trainer import Trainer

out_dir = Path(sys.argv[1])
trainer = Trainer(load_config(None, sys.argv[2:]))
trainer.train_step()
# Gradients are freed by zero_grad(set_to_none=True); measure them on one more backward.
inputs, labels = trainer._local_batch()
trainer.pm.loss(trainer.fwd(inputs), labels).backward()
trainer.pm.reshard()
stats = local_state_bytes(trainer.pm, trainer.optimizer)
(out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(stats))
exit_worker(0)  # barrier, tear the groups down, leave without interpreter finalisation
