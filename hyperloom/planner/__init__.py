"""The planner: predict step time, memory and MFU of a model x cluster x parallel strategy,
search for the best strategies, and calibrate on the machine at hand.

In the spirit of SimuMax (MooreThreads/SimuMax), except that the pipeline is not a formula:
per-op costs are laid onto the same schedule IR the executor runs (`hyperloom.pipeline`) and
replayed, so warm-up, uneven stages, exposed p2p and peak in-flight micro-batches come out of
the program itself. The planner reads the job config and never imports the trainer; the
trainer hands it measurements (`selfcheck`, `calibrate`). Files: `hardware`, `kernels`
(GEMMs by shape, attention by length), `profiles` (the built-in accelerators and their
sources), `network` (link tiers), `collectives`, `model`, `strategy`, `costs`, `memory`,
`vision` (a vlm's encoder), `simulate` (`predict` -> `Plan`), `search`, `report`, `cli`,
`flags` (`plan predict` from flags), `calibrate`, `calibrate_gemm`, `host_memory`,
`selfcheck`, `published`; docs/planner.md walks them.

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
