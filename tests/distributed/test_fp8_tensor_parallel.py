"""FP8 training with tp = 2 equals FP8 training on one process (gloo workers on CPU).

One torchrun launch (`fp8_tp_worker.py`) runs every case: recipes current, delayed, rowwise,
blockwise and mxfp8, with and without sequence parallelism, 3 SGD steps each. The FP8
quantization on the two ranks is the single process's (per-tensor amaxes all-reduced over
tp; rowwise row amaxes all-reduced where the contraction dimension is sharded: a row-parallel
layer's input and weight, a column-parallel layer's output gradient and transposed weight;
block scales local to whole blocks), so what differs is FP32 summation order. Tolerance 1e-6 relative on
every loss and on the first step's gradients; measured (pytest's environment): losses
<= 1e-7, gradients <= 4.2e-7.

Delayed scaling is the exception after its second step, for a reason that is not tensor
parallelism: its scales (fmt_max / amax, not powers of two) inherit the ~1e-7 differences
of the amaxes, so some value lying that close to an FP8 rounding boundary rounds the other
way (one E4M3 step, ~6%) and the runs separate: step 3 measured 8.5e-5 under pytest (1e-7
with compiled ops), amax histories 9e-5 from the single process's. So delayed is held to
1e-6 for two steps (the second one quantizes with scales from the history), 1e-3 after, and
its histories must be bitwise equal across the tp ranks. Current scaling shares the
boundary risk, rowwise, blockwise and MXFP8 (power-of-two scales) mostly do not. Rowwise
measured: losses equal, first-step gradients <= 2e-7 (with exact, non-power-of-two row
scales the gradients were 2% apart after one step).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("fp8_tp_worker.py")
RECIPES = ("current", "delayed", "rowwise", "blockwise", "mxfp8")
CASES = [f"{r}:{sp}" for r in RECIPES for sp in (0, 1)]


def test_fp8_tp2_equals_one_process(tmp_path):
    out = tmp_path / "fp8_tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*cmd, str(WORKER), str(out), *CASES], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(out.read_text())
    assert [r["case"] for r in results] == CASES
    bad = []
    for r in results:
        delayed = r["case"].startswith("delayed")
        strict = r["loss"][:2] if delayed else r["loss"]
        if (
            r["fp8_tp_layers"] != 14  # 2 layers x (wq, wk, wv, wo, w1, w2, w3) stay FP8
            or max(strict + [r["grad"]]) > 1e-6
            or max(r["loss"]) > 1e-3
            or (delayed and not r["history_equal_across_ranks"])
            or r.get("history_vs_single", 0.0) > 1e-3
        ):
            bad.append(r)
    assert not bad, json.dumps(bad, indent=1)
