"""`train.recompute = "auto"`: per pipeline stage, the least recompute whose predicted peak fits.

Before the model is built the trainer asks for a choice: every policy the runtime has
(`config.RECOMPUTE_CANDIDATES`) is simulated for the job's layout, and each pipeline stage
takes the one with the least predicted recompute time among those whose predicted peak, on top
of what the rank already holds, fits the memory budget (no recompute first; ties go to the
policy earlier in the list). Stages differ because a 1F1B stage r keeps p - r micro-batches in
flight, so the first stages may need recompute where the last ones do not. A budget that no
policy fits is a PlanError naming the smallest predicted peak.

The planner simulates one policy for all stages; a mixed choice is predicted, for step time,
as the uniform plan of its costliest stage policy -- an upper bound, since the other stages
recompute less.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hyperloom.config import RECOMPUTE_CANDIDATES, JobConfig
from hyperloom.planner.errors import PlanError
from hyperloom.planner.hardware import HardwareProfile
from hyperloom.planner.memory import Memory
from hyperloom.planner.selfcheck import CPU_PROFILE, job_plan
from hyperloom.planner.simulate import Plan


def _costliest(policies: tuple[str, ...]) -> str:
    """The policy latest in `RECOMPUTE_CANDIDATES` (ordered by recompute work)."""
    return max(policies, key=RECOMPUTE_CANDIDATES.index)


def counted_peak(memory: Memory, profile: HardwareProfile) -> float:
    """The predicted bytes a budget is held against: on a host, its resident peak (the
    profile's allocator model included); on a device, the caching allocator's reserved bytes
    (as `hyperloom plan` decides whether a plan fits)."""
    return memory.peak if profile.name == CPU_PROFILE else memory.reserved


@dataclass(frozen=True)
class RecomputeChoice:
    """What auto chose: a policy, predicted peak and recompute time per pipeline stage."""

    budget_bytes: float
    held_bytes: float  # what a rank holds before the model (counted against the budget)
    policies: tuple[str, ...]
    peaks: tuple[float, ...]  # predicted, above `held_bytes`
    recompute_s: tuple[float, ...]
    step_s: float  # the uniform plan of the costliest chosen policy (an upper bound)
    # every candidate: policy -> {peak_gb_by_stage, step_s}, or the reason it cannot run
    candidates: dict[str, Any] = field(default_factory=dict)

    @property
    def costliest(self) -> str:
        return _costliest(self.policies)

    def summary(self) -> dict[str, Any]:
        return {
            "policy_by_stage": list(self.policies),
            "predicted_peak_gb_by_stage": [
                round((b + self.held_bytes) / 1e9, 4) for b in self.peaks
            ],
            "predicted_above_baseline_gb_by_stage": [round(b / 1e9, 4) for b in self.peaks],
            "predicted_step_s": self.step_s,
            "budget_gb": self.budget_bytes / 1e9,
            "held_before_model_gb": self.held_bytes / 1e9,
        }

    def describe(self) -> str:
        stages = "; ".join(
            f"stage {r}: {p} (peak {(b + self.held_bytes) / 1e9:.2f} GB)"
            for r, (p, b) in enumerate(zip(self.policies, self.peaks, strict=True))
        )
        return (
            f"recompute auto, budget {self.budget_bytes / 1e9:.2f} GB per rank: {stages}; "
            f"predicted step {self.step_s:.3g} s"
        )


def choose_recompute(
    plan_of: Callable[[str], Plan],
    profile: HardwareProfile,
    budget_bytes: float,
    held_bytes: float = 0.0,
) -> RecomputeChoice:
    """Per pipeline stage, the candidate with the least predicted recompute time whose peak
    plus `held_bytes` fits `budget_bytes`; PlanError when a stage fits none. `plan_of(policy)`
    predicts the job under one policy: `job_plan` as the trainer runs it (`for_job`), or
    `hyperloom plan`'s prediction, so that its table and its choice are one model."""
    if budget_bytes <= held_bytes:
        raise PlanError(
            f"memory budget {budget_bytes / 1e9:.2f} GB is used up before the model is built "
            f"({held_bytes / 1e9:.2f} GB held); raise train.memory_budget_gb"
        )
    plans: dict[str, Any] = {}
    for policy in RECOMPUTE_CANDIDATES:
        try:
            plans[policy] = plan_of(policy)
        except PlanError as exc:
            plans[policy] = str(exc)
    runnable = {p: plan for p, plan in plans.items() if not isinstance(plan, str)}
    if not runnable:
        raise PlanError(f"recompute auto: the planner cannot cost this job: {plans['none']}")
    stages = len(next(iter(runnable.values())).memory)
    chosen, smallest = [], []
    for r in range(stages):

        def peak(policy: str, r: int = r) -> float:
            return counted_peak(runnable[policy].memory[r], profile)

        def cost(policy: str, r: int = r) -> tuple[float, int]:
            recompute = runnable[policy].rank_breakdown[r].get("recompute", 0.0)
            return recompute, RECOMPUTE_CANDIDATES.index(policy)

        fits = [p for p in runnable if peak(p) + held_bytes <= budget_bytes]
        low = min(runnable, key=peak)
        smallest.append((low, peak(low)))
        chosen.append(min(fits, key=cost) if fits else None)
    if None in chosen:
        r = chosen.index(None)
        low, low_peak = smallest[r]
        raise PlanError(
            f"no recompute policy fits train.memory_budget_gb = {budget_bytes / 1e9:.3g} on "
            f"pipeline stage {r}: the smallest predicted peak is "
            f"{(low_peak + held_bytes) / 1e9:.3g} GB ({low}, {held_bytes / 1e9:.2f} GB of it "
            "held before the model); raise the budget, or shard more (tp, pp, zero)"
        )
    policies = tuple(chosen)
    return RecomputeChoice(
        budget_bytes=budget_bytes,
        held_bytes=held_bytes,
        policies=policies,
        peaks=tuple(counted_peak(runnable[p].memory[r], profile) for r, p in enumerate(policies)),
        recompute_s=tuple(
            runnable[p].rank_breakdown[r].get("recompute", 0.0) for r, p in enumerate(policies)
        ),
        step_s=runnable[_costliest(policies)].step_time,
        candidates={
            p: plan
            if isinstance(plan, str)
            else {
                "peak_gb_by_stage": [round(counted_peak(m, profile) / 1e9, 4) for m in plan.memory],
                "step_s": plan.step_time,
            }
            for p, plan in plans.items()
        },
    )


def for_job(
    job: JobConfig,
    profile: HardwareProfile,
    world: int,
    budget_bytes: float,
    held_bytes: float = 0.0,
    compute_share: float = 1.0,
) -> RecomputeChoice:
    """The trainer's choice: each policy predicted as `job_plan` predicts the job it runs on
    `world` ranks of one machine, a rank getting `compute_share` of `profile`."""

    def plan_of(policy: str) -> Plan:
        return job_plan(job, profile, world, compute_share, recompute=policy)

    return choose_recompute(plan_of, profile, budget_bytes, held_bytes)
