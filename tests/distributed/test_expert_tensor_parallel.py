"""Expert tensor parallelism (`parallel.etp`) trains like one process (gloo workers on CPU).

The moe-tiny shape (16 experts top-2 of hidden width 192, a shared expert, MLA, one MTP
module) at tp 2 with etp 2, alone (world 2), with ZeRO-1, and with dp 2 x ep 2 (world 4:
each expert weight split two ways, experts over ep and hidden width over etp), against one
process with the same global batch: losses and gradient norms within 1e-5 for steps 1-2,
then `LATER_STEPS_TOL` (`assert_same_training`). Each rank holds 1/etp of every expert's
hidden width (the workers' `shapes_rank{R}.json`). A run saved at tp 2 x etp 2 resumes in one
process. One launch per world size (`jobs_worker.py`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import override_args
from test_expert_parallel import MOE_TINY, assert_same_training

GLOBAL_BATCH = 4
MOE_TINY_HIDDEN = 192  # the moe-tiny preset's model.moe_ffn_dim
ETP = {"parallel__tp": 2, "parallel__etp": 2}
# name: (world, overrides); micro-batch sizes keep the global batch at 4 rows
LAYOUTS = {
    "tp2-etp2": (2, {**ETP, "train__micro_batch_size": 4}),
    "tp2-etp2-dp2-ep2": (
        4,
        {**ETP, "parallel__dp": 2, "parallel__ep": 2, "train__micro_batch_size": 2},
    ),
    "tp2-etp2-dp2-ep2-zero1": (
        4,
        {
            **ETP,
            "parallel__dp": 2,
            "parallel__ep": 2,
            "parallel__zero": 1,
            "train__micro_batch_size": 2,
        },
    ),
    # etp 2 inside tp 4: two etp groups per tp group hold the same slices (the norm counts
    # them once)
    "tp4-etp2": (4, {"parallel__tp": 4, "parallel__etp": 2, "train__micro_batch_size": 4}),
    # sequence parallelism: each rank routes its own slice, the rows gathered over etp = tp
    "tp2-sp-etp2": (2, {**ETP, "parallel__sp": True, "train__micro_batch_size": 4}),
    "tp2-sp-etp2-dp2-ep2": (
        4,
        {
            **ETP,
            "parallel__sp": True,
            "parallel__dp": 2,
            "parallel__ep": 2,
            "train__micro_batch_size": 2,
        },
    ),
    # etp 1 inside tp 2 x dp 2: experts replicated over tp (today's layout) as a control
    "tp2-etp1-dp2": (4, {"parallel__tp": 2, "parallel__dp": 2, "train__micro_batch_size": 2}),
}
SAVED = {**ETP, "train__micro_batch_size": 4, "train__stop_at_step": 3}


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "train"]


def train_layouts(
    out: Path, job, jobs_train, layouts: dict, saved: dict, saved_world: int, **kw
) -> Path:
    """One launch per world size under `out/w{world}`: `layouts` (name: (world, overrides)),
    one process's reference ("moe") and a run `saved` in the `saved_world` launch that
    resumes in one process ("resumed"). `kw` goes to `jobs_train`."""

    def launch(world: int, cases: list[tuple[str, dict]]) -> None:
        cases = [(n, override_args(**a)) for n, a in cases]
        result = jobs_train(out / f"w{world}", world, job, cases, **kw)
        assert result.returncode == 0, result.stderr[-3000:]

    def of(world: int) -> list[tuple[str, dict]]:
        return [(name, extra) for name, (w, extra) in layouts.items() if w == world]

    launch(saved_world, [*of(saved_world), ("saved", saved)])
    shutil.copytree(out / f"w{saved_world}" / "saved", out / "w1" / "resumed")
    one = {"train__micro_batch_size": GLOBAL_BATCH}
    launch(1, [("moe", one), ("resumed", one)])
    for world in sorted({w for w, _ in layouts.values()} - {saved_world}):
        launch(world, of(world))
    return out


@pytest.fixture(scope="module")
def trained(tiny_job_args, jobs_train, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-etp")
    job = tiny_job_args(out / "unused", **MOE_TINY)
    return train_layouts(out, job, jobs_train, LAYOUTS, SAVED, 2, shapes=True)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_tensor_parallel_trains_like_one_process(trained, name):
    world, _ = LAYOUTS[name]
    one, got = read_metrics(trained / "w1" / "moe"), read_metrics(trained / f"w{world}" / name)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert_same_training(one, got)
    assert one[-1]["loss"] < one[0]["loss"]  # the reference trained


def test_expert_tensor_parallel_checkpoint_resumes_in_one_process(trained):
    """Saved at tp 2 x etp 2 after step 3 (expert weights gathered whole over etp), resumed
    in one process: steps 4-5 are the uninterrupted run's."""
    assert (trained / "w2" / "saved" / "checkpoints" / "step_00000003").is_dir()
    resumed = trained / "w1" / "resumed"
    summary = json.loads((resumed / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_run"]) == (5, 2)
    assert_same_training(read_metrics(trained / "w1" / "moe"), read_metrics(resumed))


@pytest.mark.parametrize(
    "name", ["tp2-etp2", "tp2-etp2-dp2-ep2", "tp4-etp2", "tp2-sp-etp2", "tp2-sp-etp2-dp2-ep2"]
)
def test_each_rank_holds_its_etp_slice_of_every_expert(trained, name):
    """w1, w3 (E, hidden, dim) and w2 (E, dim, hidden) of every routed expert bank hold
    hidden / etp columns on each rank (and E / ep experts under ep), the slice their `Shard`
    names: the etp rank is the tp rank modulo etp, the ep rank the dp rank."""
    world, layout = LAYOUTS[name]
    ep, tp = layout.get("parallel__ep", 1), layout["parallel__tp"]
    E, hidden, dim = 16, MOE_TINY_HIDDEN, MOE_TINY["model__dim"]
    for rank in range(world):
        shapes = json.loads((trained / f"w{world}" / name / f"shapes_rank{rank}.json").read_text())
        banks = sorted({n.rpartition(".")[0] for n in shapes if ".experts.w" in n})
        assert len(banks) == 3 + 1  # MoE layers 1-3 and the MTP module's
        for bank in banks:
            for w, hidden_dim in (("w1", 1), ("w3", 1), ("w2", 2)):
                got = shapes[f"{bank}.{w}"]
                whole = [E, hidden, dim] if w != "w2" else [E, dim, hidden]
                want = list(whole)
                want[0] //= ep
                want[hidden_dim] //= 2
                assert got["shape"] == want, (rank, bank, w)
                etp_split = {"dim": hidden_dim, "index": rank % 2, "parts": 2, "over": "etp"}
                if ep == 1:
                    assert got["shard"] == {**etp_split, "then": None}
                else:
                    outer = {"dim": 0, "index": (rank // tp) % ep, "parts": ep, "over": "ep"}
                    assert got["shard"] == {**outer, "then": {**etp_split, "then": None}}
