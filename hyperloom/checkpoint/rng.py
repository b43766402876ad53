"""Every random stream of a process, saved and restored so a resumed run draws what an
uninterrupted one would: Python's, NumPy's, torch's host generator and the accelerator's."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state(device_rng: torch.Tensor | None) -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": device_rng,
    }


def restore_rng(state: dict[str, Any]) -> torch.Tensor | None:
    """Restore host RNGs; returns the device RNG state for the accelerator to set."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    return state.get("device")
