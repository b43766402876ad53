"""Search the parallel strategy space for the fastest layouts that fit in memory.

The space is tp x cp (ring, or Ulysses' all-to-all where the heads per tp rank divide by cp) x
pp (dp is what remains) x ep (MoE: divisors of dp * cp that divide the experts) x etp (MoE at
tp > 1: the routed experts replicated over tp, etp 1, or split over it, etp = tp) x micro-batch
size x ZeRO x schedule (and vpp) x recompute x FP8. Three filters,
cheapest first, with counts reported: validity (`strategy.check`), memory (`memory.py` with the
schedule's own in-flight counts), and branch and bound on time -- survivors are replayed
(fast) in order of a lower bound (busiest rank's compute, no bubble) until the next bound
cannot beat the k-th best. The top k are replayed exactly. Layer costs and schedule
structures are cached, which makes thousands of points per second possible.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass, field

from hyperloom.config import PAIRING_SCHEDULES
from hyperloom.planner.errors import PlanError
from hyperloom.planner.hardware import Cluster
from hyperloom.planner.model import ModelSpec
from hyperloom.planner.simulate import (
    DEFAULT_MARGIN_GIB,
    Plan,
    lower_bound,
    memory_per_rank,
    predict,
    prepare,
)
from hyperloom.planner.strategy import RUNTIMES, Runtime, Strategy, check

log = logging.getLogger("hyperloom.planner")

_ALLOC = 0.94


@dataclass(frozen=True)
class SearchSpace:
    """Values tried per dimension; `pp=()` means every divisor of the GPU count that fits."""

    tp: tuple[int, ...] = (1, 2, 4, 8)
    cp: tuple[int, ...] = (1, 2, 4, 8)
    cp_comm: tuple[str, ...] = ("ring", "alltoall")  # at cp > 1; alltoall where heads divide
    pp: tuple[int, ...] = ()
    ep: tuple[int, ...] = ()  # () = every valid one: divisors of dp*cp dividing the experts
    dispatcher: tuple[str, ...] = ("alltoall",)
    mbs: tuple[int, ...] = (1, 2, 4)
    zero: tuple[int, ...] = (0, 1, 3)
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb-h1", "zb-v")
    vpp: tuple[int, ...] = (2, 4)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    fp8: tuple[bool, ...] = (False, True)
    # overlapped F&B pairs: tried where they can run (ep > 1, all-to-all, a pairing schedule)
    ep_overlap: tuple[bool, ...] = (False, True)
    # expert tensor parallelism: () = for MoE models at tp > 1 the routed experts replicated
    # over tp (1) and split over it (0, `Strategy.etp`); pinned values go through `check`
    etp: tuple[int, ...] = ()

    def fixed(self, **values) -> SearchSpace:
        """The space with some dimensions pinned, e.g. `fixed(tp=8, pp=4)`; `vpp` pins the
        chunks of interleaving and `schedule` a single kind."""
        out = {}
        for key, value in values.items():
            name = {"schedule": "schedules"}.get(key, key)
            if name not in {f.name for f in dataclasses.fields(self)}:
                raise PlanError(
                    f"cannot fix {key!r}; fixable: tp, cp, cp_comm, pp, ep, dispatcher, mbs, "
                    f"zero, schedule, vpp, recompute, fp8, ep_overlap, etp"
                )
            out[name] = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        return dataclasses.replace(self, **out)


@dataclass
class SearchResult:
    top: list[Plan]
    enumerated: int  # points generated
    valid: int  # passed `check` and got a time lower bound
    fitting: int  # of the memory-checked (not bounded out), those that fit
    simulated: int  # replayed on the schedule IR
    seconds: float
    rejected: Counter = field(default_factory=Counter)  # reason -> count

    @property
    def configs_per_s(self) -> float:
        """Points evaluated (checked, and costed in memory if valid) per second."""
        return self.enumerated / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        return {
            "enumerated": self.enumerated,
            "valid": self.valid,
            "fit_in_memory_of_checked": self.fitting,
            "simulated": self.simulated,
            "seconds": self.seconds,
            "configs_per_s": self.configs_per_s,
            "rejected": dict(self.rejected),
        }


def _reason(why: str) -> str:
    """A `check` message without its numbers, to count rejections by kind."""
    text = re.sub(r"\s*\([^)]*\)", "", why).split(" = ")[0].split(":")[0]
    return text.strip()[:48]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_degrees(spec: ModelSpec, dp: int, cp: int, space: SearchSpace) -> tuple[int, ...]:
    """The ep values to try for a dp x cp layout: the space's (pinned values go through
    `check`, which names the invalid ones), or every divisor of dp * cp that divides the
    routed experts; 1 for dense models."""
    if space.ep:
        return space.ep
    if not spec.n_routed_experts:
        return (1,)
    return tuple(d for d in _divisors(dp * cp) if spec.n_routed_experts % d == 0)


def expert_tensor_degrees(spec: ModelSpec, tp: int, space: SearchSpace) -> tuple[int, ...]:
    """The etp values to try at `tp`: the space's, or for MoE models at tp > 1 the routed
    experts replicated over tp (1, hyperloom's default) and split over it (0, Megatron's);
    0 otherwise, where the two are the same."""
    if space.etp:
        return space.etp
    if not spec.n_routed_experts or tp == 1:
        return (0,)
    return (1, 0)


def context_forms(spec: ModelSpec, tp: int, cp: int, space: SearchSpace) -> tuple[str, ...]:
    """The cp_comm values to try: the space's at cp > 1, Ulysses' all-to-all only where the
    query heads per tp rank divide by cp (a pinned one goes through `check`); ring at cp = 1,
    where neither runs."""
    if cp == 1:
        return ("ring",)
    if len(space.cp_comm) == 1:
        return space.cp_comm
    heads = spec.n_heads // tp if spec.n_heads % tp == 0 else 0
    return tuple(c for c in space.cp_comm if c != "alltoall" or (heads and heads % cp == 0))


def candidates(spec: ModelSpec, gpus: int, global_batch: int, space: SearchSpace, accel_fp8: bool):
    """Every point of the space for `gpus` GPUs and `global_batch` sequences per step."""
    for tp, cp in itertools.product(space.tp, space.cp):
        if gpus % (tp * cp):
            continue
        forms = context_forms(spec, tp, cp, space)
        pps = space.pp or tuple(d for d in _divisors(gpus // (tp * cp)) if d <= spec.n_layers)
        for pp in pps:
            if gpus % (tp * cp * pp):
                continue
            dp = gpus // (tp * cp * pp)
            if global_batch % dp:
                continue
            per_rank = global_batch // dp
            for mbs in space.mbs:
                if per_rank % mbs:
                    continue
                m = per_rank // mbs
                kinds = [("1f1b", 1)] if pp == 1 else []
                if pp > 1:
                    for kind in space.schedules:
                        vpps = space.vpp if kind == "interleaved" else (1,)
                        kinds += [(kind, v) for v in vpps]
                experts = [
                    (ep, d, e)
                    for ep in expert_degrees(spec, dp, cp, space)
                    for d in (space.dispatcher if ep > 1 else ("alltoall",))
                    for e in expert_tensor_degrees(spec, tp, space)
                ]
                for (ep, disp, etp), form, (kind, v), zero, rc, fp8 in itertools.product(
                    experts, forms, kinds, space.zero, space.recompute, space.fp8
                ):
                    if fp8 and not accel_fp8:
                        continue
                    if zero != 0 and dp == 1:
                        continue  # sharding over one rank is zero 0
                    # pairing schedules' F&B pairs, or gradient accumulation's at pp = 1
                    accum = pp == 1 and m > 1 and zero != 3
                    pairs = ep > 1 and disp == "alltoall" and (kind in PAIRING_SCHEDULES or accum)
                    for overlap in space.ep_overlap if pairs else (False,):
                        yield Strategy(
                            tp=tp,
                            pp=pp,
                            dp=dp,
                            cp=cp,
                            cp_comm=form,
                            ep=ep,
                            dispatcher=disp,
                            vpp=v,
                            zero=zero,
                            mbs=mbs,
                            microbatches=m,
                            schedule=kind,
                            recompute=rc,
                            fp8=fp8,
                            ep_overlap=overlap,
                            etp=etp,
                        )


def search(
    spec: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    seq: int,
    runtime: Runtime | str = "hyperloom",
    space: SearchSpace | None = None,
    top_k: int = 10,
    margin_gib: float = DEFAULT_MARGIN_GIB,
    exact_actions: int = 4096,
) -> SearchResult:
    """The `top_k` fastest strategies that fit (see module docstring)."""
    rt = RUNTIMES[runtime] if isinstance(runtime, str) else runtime
    space = space or SearchSpace()
    start = time.perf_counter()
    capacity = (cluster.profile.hbm_gib - margin_gib) * 2**30
    rejected: Counter = Counter()
    bounded: list[tuple[float, int, Strategy, object]] = []
    enumerated = valid = 0
    points = candidates(spec, cluster.gpus, global_batch, space, cluster.profile.supports_fp8)
    for i, s in enumerate(points):
        enumerated += 1
        why = check(s, spec, seq, cluster.gpus)
        if why:
            rejected["invalid: " + _reason(why)] += 1
            continue
        valid += 1
        prep = prepare(spec, cluster, s, seq, rt)
        bounded.append((lower_bound(s, prep, cluster, rt), i, s, prep))
    bounded.sort(key=lambda t: (t[0], t[1]))

    best: list[tuple[float, int, Plan]] = []  # max-heap on step time (negated)
    simulated = memory_checked = fitting = 0
    for bound, i, s, prep in bounded:
        if len(best) >= top_k and bound >= -best[0][0]:
            rejected["bounded out (time)"] += 1
            continue
        memory_checked += 1
        ranks = tuple(sorted({0, min(1, s.pp - 1), s.pp - 1}))
        mems = memory_per_rank(spec, s, seq, rt, prep, ranks, cluster.profile.host_memory)
        peak = max(m.peak for m in mems)
        if peak / _ALLOC > capacity:
            rejected["over memory"] += 1
            continue
        fitting += 1
        plan = predict(spec, cluster, s, seq, rt, margin_gib, fast=True, prep=prep)
        simulated += 1
        item = (-plan.step_time, -i, plan)
        if len(best) < top_k:
            heapq.heappush(best, item)
        elif plan.step_time < -best[0][0]:
            heapq.heapreplace(best, item)
    if not valid:
        raise PlanError(
            f"no valid strategy for {spec.name} on {cluster.gpus} x {cluster.profile.name}: "
            f"{enumerated} points, rejected {dict(rejected)}"
        )
    if not best:
        raise PlanError(
            f"no strategy for {spec.name} on {cluster.gpus} x {cluster.profile.name} fits in "
            f"{cluster.profile.hbm_gib - margin_gib:.1f} GiB: {enumerated} points, rejected "
            f"{dict(rejected)}"
        )
    exact = []
    for plan in sorted((p for _, _, p in best), key=lambda p: p.step_time):
        s = plan.strategy
        if s.pp * s.microbatches * s.stages_per_rank <= exact_actions:
            plan = predict(spec, cluster, s, seq, rt, margin_gib)
        if plan.fits:
            exact.append(plan)
        else:
            rejected["over memory (exact, all ranks)"] += 1
    # Step times within 0.1% are a tie (well inside the model's error): less memory wins.
    fastest = min((p.step_time for p in exact), default=1.0)
    exact.sort(key=lambda p: (round(p.step_time / fastest, 3), p.peak_memory))
    seconds = time.perf_counter() - start
    log.info(
        "searched %d points (%d valid) in %.2f s: %d memory-checked, %d fit, %d replayed",
        enumerated,
        valid,
        seconds,
        memory_checked,
        fitting,
        simulated,
    )
    return SearchResult(
        top=exact,
        enumerated=enumerated,
        valid=valid,
        fitting=fitting,
        simulated=simulated,
        seconds=seconds,
        rejected=rejected,
    )
