"""The guard drives any run that implements `GuardedRun`, not only the trainer.

A stand-in run (one parameter, a counter for the data position) saves through the guard
every 2 steps and reports a NaN loss at step 9: the guard must roll it back through the
protocol alone -- load the stable checkpoint of step 6, keep the data position past the bad
window, lower its own learning-rate scale, drop the newer checkpoint -- and persist that
scale with its state. The trainer's end-to-end rollbacks are in test_resilience_recovery.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hyperloom import checkpoint as ckpt
from hyperloom.config import load_config
from hyperloom.parallel import build_mesh
from hyperloom.resilience.events import read_events
from hyperloom.resilience.guard import Guard


class StandInRun:
    """The smallest `GuardedRun` (structurally: it does not derive from it); what the guard
    asked of it is recorded for the asserts."""

    def __init__(self, cfg) -> None:
        self.cfg, self.mesh = cfg, build_mesh(cfg.parallel, None)
        self.step, self.resumed_from = 0, None
        self.position = {"batch": 0}
        self.weight = torch.nn.Parameter(torch.zeros(3))
        self.loaded: list[Path] = []
        self.barriers = 0
        self.guard = Guard(self)

    def local_parameters(self) -> list[torch.nn.Parameter]:
        return [self.weight]

    def load_checkpoint(self, path: Path) -> None:
        state = ckpt.load_train_state(path)
        self.weight.data.copy_(ckpt.load_model_state(path)["weight"])
        self.step, self.position = state["step"], state["loader"]
        self.guard.load_state_dict(state["resilience"])
        self.loaded.append(path)

    def data_position(self) -> dict[str, Any]:
        return dict(self.position)

    def set_data_position(self, position: dict[str, Any]) -> None:
        self.position = dict(position)

    def barrier(self) -> None:
        self.barriers += 1

    def synchronize(self) -> None:
        pass

    def save(self) -> None:
        train_state = {
            "step": self.step,
            "loader": self.data_position(),
            "resilience": self.guard.state_dict(),
        }
        self.guard.save(self.step, {"weight": self.weight}, train_state, {}, {}, wait=True)


def test_guard_rolls_back_a_run_through_the_protocol(tmp_path, tiny_job_args):
    args = tiny_job_args(
        tmp_path,
        resilience__on_anomaly="rollback",
        resilience__stable_steps=2,
        resilience__lr_factor=0.5,
        checkpoint__every=2,
        checkpoint__keep=5,
    )
    run = StandInRun(load_config(None, args))
    guard = run.guard
    for step in range(1, 10):
        loss = torch.tensor(float("nan") if step == 9 else 1.0)
        if guard.healthy(step, loss, torch.tensor(1.0)):
            run.weight.data.fill_(step)  # the "update" of this step
        run.step, run.position = step, {"batch": step}
        guard.after_step()
        if step % run.cfg.checkpoint.every == 0:
            run.save()
    guard.close()

    assert run.loaded == [ckpt.checkpoint_dir(tmp_path, 6)]
    assert run.step == 6 and run.weight.tolist() == [6.0] * 3
    assert run.position == {"batch": 9}  # past the window of steps 7..9: not replayed
    assert guard.lr_scale == 0.5 and guard.state_dict()["lr_scale"] == 0.5
    assert ckpt.committed_steps(tmp_path) == [2, 4, 6]  # step 8's timeline is abandoned
    assert run.barriers == 1
    log = "\n".join(read_events(tmp_path))
    assert "[rollback] anomaly at step 9 (nonfinite)" in log and "learning rate x 0.5" in log
