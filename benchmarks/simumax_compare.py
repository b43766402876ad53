"""The planner beside SimuMax's own model, component by component, on SimuMax's 43 measured
B200 runs (docs/planner.md, validation 6c, "What moved 6c third").

    python benchmarks/simumax_compare.py --simumax PATH [--python PY]

PATH is a checkout of MooreThreads/SimuMax (the planner's rows come from commit 4dcaae5);
PY a Python with its requirements (numpy, pandas, sympy, tabulate, tqdm, matplotlib), by
default this one. SimuMax runs in a subprocess (`simumax_cases.py`); the table sets its
last pipeline stage's compute, exposed communication, optimizer, dp and bubble beside the
planner's (`Plan.rank_breakdown[-1]`), in ms (bubble: SimuMax's (pp - 1) x the first
stage's micro-batch, the planner's time the last rank waits), and the JSON goes to
benchmarks/results/simumax_compare.json. Nothing of the planner is set from it: it shows
where two models of the same runs part.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simumax_cases import case_number  # noqa: E402  (benchmarks/ is on sys.path)

from hyperloom.planner.published_memory import SIMUMAX_B200, case_name, simumax_plan  # noqa: E402

COLUMNS = ("compute", "comm", "optimizer", "dp", "bubble")


def _key(case: str) -> tuple:
    """(model, layers, tp, pp, cp, ep, seq, micro-batches) of a SimuMax case name."""
    model = {"deepseekv2": "deepseek-v2", "deepseekv3": "deepseek-v3"}.get(
        case.split("_")[0], "llama3-70b" if "70b" in case else "llama3-405b"
    )
    dims = (case_number(case, k) for k in ("_l", "_tp", "_pp", "_cp", "_ep"))
    return (model, *dims, case_number(case, "seq", 4096), case_number(case, "_mbc"))


def simumax_parts(rec: dict) -> dict[str, float]:
    last = rec["last_stage"]
    return {
        "compute": last["fwd_compute_time"] + last["bwd_compute_time"] + last["recompute_time"],
        "comm": last["intra_exposed_time"] + last["inter_exposed_time"],
        "optimizer": last["optim_time"],
        "dp": last["dp_exposed_time"],
        "bubble": rec["bubble_ms"],
    }


def planner_parts(plan) -> dict[str, float]:
    b = plan.rank_breakdown[-1]
    comm = b["tp_comm"] + b["cp_comm"] + b.get("ep_comm", 0.0)
    parts = {"compute": b["compute"], "comm": comm, "optimizer": b["optimizer"]}
    parts |= {"dp": b["dp_sync_exposed"], "bubble": b["pipeline_bubble"]}
    return {k: v * 1e3 for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--simumax", required=True, type=Path, help="a MooreThreads/SimuMax checkout")
    ap.add_argument("--python", default=sys.executable, help="a Python with its requirements")
    args = ap.parse_args()
    summary = args.simumax / "docs/b200/b200_release_v1.2_summary.json"
    if not summary.is_file():
        sys.exit(f"error: {args.simumax} is not a SimuMax checkout (no {summary.name} there)")
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "simumax.json"
        print(f"running SimuMax's model on its release rows ({args.python}) ...", flush=True)
        helper = Path(__file__).with_name("simumax_cases.py")
        done = subprocess.run([args.python, str(helper), str(args.simumax), str(dest)])
        if done.returncode:
            sys.exit(f"error: SimuMax's run failed (exit {done.returncode}); see above")
        records = json.loads(dest.read_text())
    rows = {}
    for row in SIMUMAX_B200:
        for m in row[9]:
            rows[(*row[:7], m)] = row
    out, head = [], f"{'case':46s} {'meas':>8s} {'simu':>8s} {'ours':>8s}"
    print(head + "".join(f" | {c[:5]:>7s} S/O" + " " * 6 for c in COLUMNS))
    for rec in records:
        key = _key(rec["case"])
        plan = simumax_plan(rows[key], key[-1])
        sim, ours = simumax_parts(rec), planner_parts(plan)
        name = f"{case_name(rows[key])} mbc {key[-1]}"
        step = plan.step_time * 1e3
        line = f"{name:46s} {rec['measured_ms']:8.1f} {rec['simumax_ms']:8.1f} {step:8.1f}"
        print(line + "".join(f" | {sim[c]:7.1f} {ours[c]:7.1f}" for c in COLUMNS))
        out.append({"case": name, "measured_ms": rec["measured_ms"],
                    "simumax_ms": rec["simumax_ms"], "planner_ms": step,
                    "simumax": sim, "planner": ours})  # fmt: skip

    def mean_err(k: str) -> float:
        return sum(abs(r[k] / r["measured_ms"] - 1) for r in out) / len(out)

    print(f"\nmean |error| against the measured steps: SimuMax {mean_err('simumax_ms'):.1%}, "
          f"planner {mean_err('planner_ms'):.1%} ({len(out)} rows)")  # fmt: skip
    dest = ROOT / "benchmarks/results/simumax_compare.json"
    dest.write_text(json.dumps({"simumax_commit_expected": "4dcaae5", "rows": out}, indent=1))
    print(f"wrote {dest.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
