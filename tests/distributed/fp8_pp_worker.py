"""torchrun worker: FP8 training with pipeline parallelism against one process, in one launch.

Usage: torchrun --nproc-per-node 2 fp8_pp_worker.py OUT.json CASE [CASE ...], each CASE
`recipe:schedule` (e.g. `delayed:zb-h1`). For each case every rank builds its pp = 2 chunks
with `build_pipeline` (FP8 linears converted per chunk) and, on the side, the whole FP8 model
on one device with the same seed. The single process runs the step's micro-batches one after
the other, each loss scaled by 1 / micro-batches (gradient accumulation, which is what a
stage sees: its micro-batches in order); both take STEPS SGD steps (see fp8_tp_worker.py for
why SGD), unclipped: the clipping coefficient comes from a norm summed in another order,
and a last-bit difference in the weights may push a value across an FP8 rounding boundary
(one E4M3 step, ~6%) when scales are not powers of two. Rank 0 writes per case the relative loss differences
per step, how many FP8 weight-gradient GEMMs a split-backward schedule deferred to W, and for
delayed scaling the worst relative difference of the gathered amax histories from the single
process's, whether every copy of a module's scaling state (DualPipe holds each chunk on two
ranks) is equal after training, and whether a fresh pipeline given the saved weights and
scaling state (`fp8_state_dict` / `load_fp8_state_dict`, gathered by global name) takes the
next step bit for bit like the pipeline that went on.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from fp8_tp_worker import reference_model  # torchrun puts this directory on sys.path
from pipeline_worker import run_cases

from hyperloom.config import config_from_dict
from hyperloom.engine.fp8 import fp8_state_dict
from hyperloom.engine.fp8.convert import fp8_buffers
from hyperloom.parallel import build_mesh
from hyperloom.pipeline.runtime import build_pipeline

# ffn_dim 256: w2's contraction spans two 128-wide blocks (blockwise promotes between them).
MODEL = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=256, vocab_size=128)
SEQ, MBS, STEPS, LR = 16, 2, int(os.environ.get("FP8_PP_STEPS", 5)), 0.2


def _pipeline(cfg, acc):
    mesh = build_mesh(cfg.parallel, acc)
    pm = build_pipeline(cfg, mesh, acc.device)
    return pm, torch.optim.SGD(pm.inner.parameters(), lr=LR)


def _step(pm, opt, x, y) -> float:
    loss = pm.run_step(x, y).item()
    pm.reduce_and_clip(opt, float("inf"))  # no clipping: the grad-norm sum order differs
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _copies(pm) -> tuple[int, bool]:
    """(most copies of one module's scaling state over the pipeline ranks, all copies equal)."""
    local: dict[str, list[torch.Tensor]] = {}
    for chunk in pm.inner.chunks.values():
        for key, buf in fp8_buffers(chunk).items():
            local.setdefault(key, []).append(buf.clone())
    parts: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    held: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for key, bufs in (part or {}).items():
            held.setdefault(key, []).extend(bufs)
    equal = all(torch.equal(bufs[0], b) for bufs in held.values() for b in bufs)
    return max(len(bufs) for bufs in held.values()), equal


def run_case(case: str, acc) -> dict:
    recipe, schedule = case.split(":")
    raw = {
        "model": {**MODEL, "max_seq_len": SEQ},
        "parallel": {"pp": 2, "pp_schedule": schedule},
        "precision": {"dtype": "fp32", "fp8": recipe},
        "train": {"micro_batch_size": MBS, "device": "cpu"},
        "data": {"seq_len": SEQ},
    }
    cfg = config_from_dict(raw, world_size=2)
    pm, opt = _pipeline(cfg, acc)
    m = pm.micro_batches
    deferred = []
    put = pm.executor.store.put
    pm.executor.store.put = lambda job: put(job) and not deferred.append(job.__name__)

    ref = reference_model(cfg, acc.device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

    gen = torch.Generator().manual_seed(1234)
    out = {"case": case, "loss": [], "abs_loss": []}
    batches = []
    for _ in range(STEPS + 1):
        tokens = torch.randint(0, MODEL["vocab_size"], (MBS * m, SEQ + 1), generator=gen)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    for x, y in batches[:STEPS]:
        ref_loss = 0.0
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            part = ref(xs, labels=ys) / m  # the fused head the last stage uses
            part.backward()
            ref_loss += part.item()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        loss = _step(pm, opt, x, y)
        out["loss"].append(abs(loss - ref_loss) / abs(ref_loss))
        out["abs_loss"].append(ref_loss)
    out["fp8_wgrad_deferred"] = deferred.count("fp8_wgrad")
    if recipe == "delayed":
        mine, theirs = pm.fp8_state_dict(), fp8_state_dict(ref)
        assert mine and set(mine) == set(theirs), (sorted(mine)[:4], sorted(theirs)[:4])
        worst = 0.0
        for key, value in mine.items():
            r = theirs[key]
            worst = max(worst, ((value - r).abs().max() / r.abs().max().clamp(min=1e-30)).item())
        out["history_vs_single"] = worst
        out["copies"], out["copies_equal"] = _copies(pm)
        # Resume: a fresh pipeline with the saved weights (by global name) and FP8 state.
        weights = {n: p.detach().clone() for n, p in pm.local_params()}
        again, again_opt = _pipeline(cfg, acc)
        with torch.no_grad():
            for n, p in again.local_params():
                p.copy_(weights[n])
        again.load_fp8_state_dict(mine)
        x, y = batches[STEPS]
        went_on, resumed = _step(pm, opt, x, y), _step(again, again_opt, x, y)
        theirs, ours = pm.fp8_state_dict(), again.fp8_state_dict()
        out["resume_bitwise"] = went_on == resumed and all(
            torch.equal(value, ours[key]) for key, value in theirs.items()
        )
    return out


if __name__ == "__main__":
    run_cases(run_case)
