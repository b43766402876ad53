"""Run SimuMax's own model on the 43 measured B200 runs of its release table (helper of
`simumax_compare.py`; run with a Python that has SimuMax's requirements installed).

    python benchmarks/simumax_cases.py SIMUMAX_CHECKOUT OUT.json

Each row of ``docs/b200/b200_release_v1.2_summary.json`` is rebuilt with the checkout's own
case builders (``tools/b200/run_megatron_perf_real_pipeline``: Llama 3 70B / 405B dense
cases, DeepSeek-V2 / -V3 MoE cases with one dense layer) and TE's fused cross-entropy (the
rows' "_cef"), straggler model off, as its release table was produced; the JSON keeps the
step time and the last pipeline stage's breakdown per case, in milliseconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import warnings
from pathlib import Path


def case_number(case: str, key: str, default: int = 1) -> int:
    """The number after `key` in a release case name ("_tp" in "..._tp2_..."), or `default`."""
    m = re.search(key + r"(\d+)", case)
    return int(m.group(1)) if m else default


def _ms(text: str) -> float:
    value, unit = (text.split() + ["ms"])[:2]
    return float(value) * {"ms": 1.0, "s": 1e3, "us": 1e-3}.get(unit, 1.0)


def build_case(pipeline, case: str) -> dict:
    """One release row as the checkout's case dictionary."""
    tp, pp, ep, cp = (case_number(case, k) for k in ("_tp", "_pp", "_ep", "_cp"))
    layers, mbc = case_number(case, "_l"), case_number(case, "_mbc")
    seq = case_number(case, "seq", 4096)
    if case.startswith("deepseek"):
        out = pipeline.moe_case(
            case, strategy_rel="configs/strategy/ep8_pp1_dp8_mbs1.json", parallel="-",
            layer_num=layers, micro_batch_num=mbc, pp_size=pp, ep_size=ep,
        )  # fmt: skip
        if case.startswith("deepseekv3"):
            out["model_rel"] = "configs/models/deepseekv3.json"
        out["model_overrides"]["dense_layers"] = 1
        return out
    model = "llama3-70b.json" if "70b" in case else "llama3-405b_padding_128.json"
    out = pipeline.dense_case(
        case, model_rel=f"configs/models/{model}", model_name="-", model_type_arg="-",
        strategy_rel="configs/strategy/tp1_pp1_dp8_mbs1.json", parallel="-", layer_num=layers,
        tp_size=tp, pp_size=pp, micro_batch_num=mbc, cp_size=cp,
    )  # fmt: skip
    out["strategy_overrides"]["seq_len"] = seq
    return out


def main() -> None:
    root, dest = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    sys.path.insert(0, str(root))
    warnings.filterwarnings("ignore")
    os.chdir(root)
    from tools.b200 import run_megatron_perf_real_pipeline as pipeline

    summary = json.loads((root / "docs/b200/b200_release_v1.2_summary.json").read_text())
    out = []
    for i, row in enumerate(summary["rows"], 1):
        with contextlib.redirect_stdout(io.StringIO()):
            perf = pipeline.configure_perf(build_case(pipeline, row["case"]), row["system_rel"])
            perf.strategy.cross_entropy_loss_fusion = True
            perf.strategy.enable_straggler_model = False
            perf.run_estimate()
            data = perf.analysis_cost().data
        last = data.get("breakdown_result_last_stage", data["breakdown_result"])
        chunks = data["all_chunk_times"]
        chunk = chunks.get("last_stage_chunk") or chunks["first_stage_chunk"]
        rec = {
            "case": row["case"],
            "measured_ms": row["real_ms"],
            "published_ms": row["perf_ms"],
            "simumax_ms": _ms(data["duration_time_per_iter"]),
            "last_stage": {k: _ms(v) for k, v in last.items()},
            "bubble_ms": _ms(chunk.get("bubble_time", "0 ms")),
        }
        out.append(rec)
        print(f"[{i}/{len(summary['rows'])}] {row['case']}: {rec['simumax_ms']:.1f} ms", flush=True)
    dest.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
