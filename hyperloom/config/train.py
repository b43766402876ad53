"""The `[train]` section: optimisation and the training loop (hyperloom.train)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob, positive

RECOMPUTE_MODULES = ("core_attn", "mlp_act", "norm", "experts", "mla_up")
SELECTIVE = ("core_attn", "mlp_act")
# What `train.recompute = "auto"` chooses among, in order of recompute work (planner.autorecompute)
RECOMPUTE_CANDIDATES = ("none", "norm", "mlp_act", "core_attn", "selective",
                        "core_attn,mlp_act,norm", "experts", "selective,experts", "mla_up",
                        "mla_up,mlp_act,experts", "core_attn,mlp_act,norm,experts,mla_up",
                        "full")  # fmt: skip


def is_auto(policy: str) -> bool:
    """Whether `train.recompute` asks the planner to choose (`planner.autorecompute`)."""
    return policy.strip().lower() == "auto"


def recompute_policy(policy: str) -> tuple[bool, frozenset[str]]:
    """'none' | 'full' | 'selective' | 'core_attn,mlp_act,...' -> (full, modules); a
    ValueError says what is allowed. 'selective' is the cheap, memory-heavy pair (Megatron's
    selective recompute is core_attn alone), also inside a list ('selective,experts')."""
    p = policy.strip().lower()
    if is_auto(p):
        raise ValueError(
            "auto is not a policy the model runs: the trainer asks the planner for one "
            "(train.memory_budget_gb) before it builds the model"
        )
    if p in ("none", ""):
        return False, frozenset()
    if p == "full":
        return True, frozenset(RECOMPUTE_MODULES)
    named = {m.strip() for m in p.replace("+", ",").split(",") if m.strip()}
    mods = frozenset((named - {"selective"}) | (set(SELECTIVE) if "selective" in named else set()))
    bad = sorted(mods - set(RECOMPUTE_MODULES))
    if bad:
        raise ValueError(
            f"unknown recompute module(s) {bad}; use none, full, selective or a list of "
            f"{', '.join(RECOMPUTE_MODULES)} (selective may stand for core_attn,mlp_act in it)"
        )
    return False, mods


if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and the training loop."""

    steps: int = knob(300, "optimizer steps to run")
    stop_at_step: int = knob(
        0, "save and stop at this step; the schedule still plans train.steps (0 = off)"
    )
    micro_batch_size: int = knob(8, "sequences per forward/backward")
    grad_accum: int = knob(1, "micro-batches accumulated per optimizer step")
    lr: float = knob(3e-3, "peak learning rate")
    min_lr_ratio: float = knob(0.1, "final learning rate as a fraction of the peak")
    schedule: str = knob(
        "cosine", "LR schedule after warmup", choices=["cosine", "wsd", "constant"]
    )
    warmup_steps: int = knob(30, "linear warmup steps")
    decay_fraction: float = knob(0.2, "wsd: fraction of the steps spent decaying")
    weight_decay: float = knob(0.1, "AdamW decoupled weight decay (not on norms/biases)")
    beta1: float = knob(0.9, "AdamW beta1")
    beta2: float = knob(0.95, "AdamW beta2")
    eps: float = knob(1e-8, "AdamW epsilon")
    grad_clip: float = knob(1.0, "max global gradient norm (0 = no clipping)")
    seed: int = knob(1234, "seed for initialisation and data order")
    eval_every: int = knob(100, "steps between validations (0 = only at the end)")
    eval_batches: int = knob(8, "validation batches per evaluation")
    device: str = knob("auto", "cpu, cuda, musa, ... or auto (see hyperloom.accelerator)")
    compile: bool = knob(False, "wrap the model in torch.compile")
    recompute: str = knob(
        "none",
        "activation recompute: none, full (blocks keep only their input), selective "
        "(core_attn,mlp_act), a list of core_attn, mlp_act, norm, and for the DeepSeek family "
        "experts (the routed experts) and mla_up (MLA's up-projections with the attention "
        "core; hyperloom.parallel.recompute), "
        "or auto: per pipeline stage the least recompute whose predicted peak fits "
        "train.memory_budget_gb (hyperloom.planner.autorecompute)",
    )
    recompute_layers: int = knob(0, "blocks per model chunk that recompute, first ones (0 = all)")
    memory_budget_gb: float = knob(
        0.0,
        "recompute auto: the peak memory a rank may use, GB (0 = the device's capacity minus "
        "the planner's margin; on CPU the host memory available, shared by the local ranks)",
    )
    freeze: list[str] = knob(
        doc="parameters that do not train: parts (vision, projector, decoder of a vlm) or "
        'globs over names, e.g. ["vision", "decoder"] aligns a vlm\'s projector alone',
        factory=list,
    )
    host_allocator: str = knob(
        "cache",
        "CPU runs: glibc malloc keeps freed memory for reuse, as a caching allocator does "
        "(cache), or is left as it is (system); see hyperloom.accelerator",
        choices=["cache", "system"],
    )

    def problems(self, job: JobConfig) -> list[str]:
        """Sizes, learning-rate schedule and AdamW settings in range."""
        t = self
        p = [
            *positive("train.steps", t.steps),
            *positive("train.micro_batch_size", t.micro_batch_size),
            *positive("train.grad_accum", t.grad_accum),
            *positive("train.lr", t.lr),
            *positive("train.eval_batches", t.eval_batches),
        ]
        if t.warmup_steps < 0:
            p.append(f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
        if not 0.0 <= t.min_lr_ratio <= 1.0:
            p.append(f"train.min_lr_ratio must lie in [0, 1], got {t.min_lr_ratio}")
        if not 0.0 < t.decay_fraction <= 1.0:
            p.append(
                f"train.decay_fraction must lie in (0, 1] (the wsd schedule's decay), "
                f"got {t.decay_fraction}"
            )
        for key, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
            if not 0.0 <= beta < 1.0:
                p.append(f"{key} must lie in [0, 1), got {beta}")
        for key, value in (
            ("train.weight_decay", t.weight_decay),
            ("train.grad_clip", t.grad_clip),
            ("train.eps", t.eps),
            ("train.eval_every", t.eval_every),
            ("train.stop_at_step", t.stop_at_step),
            ("train.recompute_layers", t.recompute_layers),
            ("train.memory_budget_gb", t.memory_budget_gb),
        ):
            if value < 0:
                p.append(f"{key} must be >= 0, got {value}")
        if is_auto(t.recompute):
            if t.recompute_layers:
                p.append(
                    "train.recompute = auto chooses a policy for whole model chunks; "
                    f"set train.recompute_layers = 0 (got {t.recompute_layers})"
                )
        else:
            try:
                recompute_policy(t.recompute)
            except ValueError as exc:
                p.append(f"train.recompute: {exc}")
            if t.memory_budget_gb:
                p.append(
                    f"train.memory_budget_gb = {t.memory_budget_gb} is read by "
                    f"train.recompute = auto only (train.recompute = {t.recompute!r})"
                )
        return p
