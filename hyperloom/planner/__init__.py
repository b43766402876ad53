"""The planner: predict step time, memory and MFU of a model x cluster x parallel strategy,
search for the best strategies, and calibrate on the machine at hand.

In the spirit of SimuMax (MooreThreads/SimuMax), with one difference that matters: the
pipeline is not a formula. Per-op costs are laid onto the *same* schedule IR the executor
runs (`hyperloom.pipeline`: 1F1B, interleaved, ZB-H1, ZB-V, DualPipe, DualPipeV) and replayed
event by event, so warm-up, cool-down, uneven first/last stages, exposed p2p transfers and the
number of micro-batches each rank holds at its peak come out of the program itself.

The planner reads the job config and the schedule IR; it never imports the trainer. The
trainer calls it (`selfcheck`) with what it measured, and hands `calibrate` its memory probe.

The pieces, each a file:

- `hardware`: `HardwareProfile`s of accelerators (H100, H200, A100, B200, MI300X, MTT S4000)
  as data with their sources, a GEMM efficiency model, JSON profiles; `Cluster`.
- `collectives`: alpha-beta ring costs per topology level, NIC sharing, rank-order strides.
- `model`: `ModelSpec` (a job's `ModelConfig`: dense Llama, DeepSeek MoE/MLA/MTP; the
  published GPTs) and `build_layer`, the one list of GEMMs, attention work, memory traffic
  and saved tensors that both costs and memory read.
- `strategy`: `Strategy` (tp, pp, vpp, dp, cp, ep, ZeRO, micro-batches, schedule, recompute,
  FP8; `Strategy.from_job`) with `check`, and `Runtime` (hyperloom's or Megatron's storage
  and overlap; `Runtime.from_job`).
- `costs`: per-layer and per-chunk F/B/W seconds with exposed TP/CP/ZeRO-3 communication,
  data-parallel sync and the optimizer step.
- `memory`: model states per ZeRO mode, activations per recompute mode, buffers, headroom.
- `simulate`: `predict` -> `Plan` (the glue onto `pipeline.simulate`).
- `search`: the grid, its filters and branch and bound.
- `report`, `cli`: tables, JSON, plots; `hyperloom plan predict | search | calibrate`.
- `calibrate`, `host_memory`: measure this machine into a profile.
- `selfcheck`: a training run's prediction beside its measurement.
- `published`: the published data points and the comparison (docs/planner.md).

    >>> from hyperloom.config import ModelConfig
    >>> from hyperloom.planner import Cluster, ModelSpec, Strategy, predict
    >>> shape = ModelConfig(
    ...     n_layers=8, dim=1024, n_heads=8, n_kv_heads=8, ffn_dim=4096, vocab_size=32000
    ... )
    >>> spec = ModelSpec(shape, "toy")
    >>> plan = predict(spec, Cluster.of("h100", 8), Strategy(tp=8, mbs=1), seq=2048)
    >>> 0 < plan.mfu < 1 and plan.fits
    True
"""

from hyperloom.planner.errors import PlanError
from hyperloom.planner.hardware import PROFILES, Cluster, HardwareProfile, get_profile
from hyperloom.planner.model import ModelSpec
from hyperloom.planner.search import SearchResult, SearchSpace, search
from hyperloom.planner.simulate import Plan, predict
from hyperloom.planner.strategy import RUNTIMES, Runtime, Strategy

__all__ = [
    "PROFILES",
    "RUNTIMES",
    "Cluster",
    "HardwareProfile",
    "ModelSpec",
    "Plan",
    "PlanError",
    "Runtime",
    "SearchResult",
    "SearchSpace",
    "Strategy",
    "get_profile",
    "predict",
    "search",
]
