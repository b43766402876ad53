"""`hyperloom plan predict` without a job file: one model and layout from flags.

    hyperloom plan predict --model llama3-70b --layers 20 --tp 8 --pp 2 --dp 4 --mbs 1 \\
        --microbatches 16 --seq 8192 --recompute full --accelerator b200
    hyperloom plan predict --dim 4096 --layers 32 --heads 32 --kv-heads 8 --ffn 14336 \\
        --vocab 128256 --tp 2 --dp 4 --global-batch 64 --seq 4096 --accelerator a100-pcie

Each model and layout flag is a short name for one job key (`JOB_FLAGS`), handed on as the
dotted override a job file would take (``--dim 4096`` is ``--model.dim 4096``), so a job built
from flags is read, checked and planned exactly as a TOML one; flags also override a CONFIG's
keys. A preset (``--model``) fills the shape and flags change it (a layer-truncated model:
``--model deepseek-v3 --layers 8``); without one the shape flags describe a Llama-family model
from the config's defaults. ``--microbatches`` (or ``--global-batch``, sequences per step) and
``--no-sp`` change the layout the job implies (`apply_layout`), since a job spells the
micro-batch count differently with and without a pipeline.
"""

from __future__ import annotations

import argparse
import dataclasses

from hyperloom.config.args import number
from hyperloom.planner.errors import PlanError
from hyperloom.planner.strategy import Strategy

# flag (argparse dest) -> the job key it sets, with its help
JOB_FLAGS: dict[str, tuple[str, str]] = {
    "dim": ("model.dim", "hidden size"),
    "layers": ("model.n_layers", "transformer blocks (fewer than a preset's: a truncated model)"),
    "heads": ("model.n_heads", "query heads"),
    "kv_heads": ("model.n_kv_heads", "key/value heads"),
    "ffn": ("model.ffn_dim", "dense MLP width"),
    "vocab": ("model.vocab_size", "vocabulary"),
    "experts": ("model.n_routed_experts", "MoE: routed experts (a deepseek-family model)"),
    "shared_experts": ("model.n_shared_experts", "MoE: shared experts"),
    "top_k": ("model.moe_top_k", "MoE: routed experts per token"),
    "moe_ffn": ("model.moe_ffn_dim", "MoE: one expert's width"),
    "dense_layers": ("model.n_dense_layers", "MoE: leading dense layers"),
    "tp": ("parallel.tp", "tensor parallel size"),
    "pp": ("parallel.pp", "pipeline parallel size"),
    "dp": ("parallel.dp", "data parallel size"),
    "cp": ("parallel.cp", "context parallel size"),
    "ep": ("parallel.ep", "expert parallel size (folded over dp x cp)"),
    "etp": ("parallel.etp", "expert tensor parallel size (0 = tp)"),
    "zero": ("parallel.zero", "ZeRO mode: 0, 1 or 3"),
    "mbs": ("train.micro_batch_size", "sequences per micro-batch"),
}


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """The model and layout flags of `plan predict` (module docstring)."""
    p.add_argument("--model", help="model preset (e.g. llama3-70b); shape flags change it")
    for dest, (key, text) in JOB_FLAGS.items():
        flag = "--" + dest.replace("_", "-")
        p.add_argument(flag, dest=dest, type=number(int, least=0), help=f"{text} ({key})")
    p.add_argument(
        "--microbatches",
        type=number(int, least=1),
        help="micro-batches per step per dp rank (default: the job's)",
    )
    p.add_argument(
        "--global-batch",
        type=number(int, least=1),
        help="sequences per step; micro-batches = global batch / (dp x mbs)",
    )
    p.add_argument("--no-sp", action="store_true", help="tensor parallelism without SP")


def job_overrides(args: argparse.Namespace) -> list[str]:
    """The dotted overrides the flags stand for (``--model`` as ``--model.preset``)."""
    out: list[str] = []
    if getattr(args, "model", None):
        out += ["--model.preset", args.model]
    for dest, (key, _) in JOB_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            out += [f"--{key}", str(value)]
    return out


def has_job_flags(args: argparse.Namespace) -> bool:
    """Whether any flag describes a model (a preset or a shape)."""
    return bool(getattr(args, "model", None)) or any(
        getattr(args, d, None) is not None for d in JOB_FLAGS if JOB_FLAGS[d][0][:6] == "model."
    )


def apply_layout(s: Strategy, args: argparse.Namespace) -> Strategy:
    """`s` with ``--microbatches``/``--global-batch`` and ``--no-sp`` applied."""
    m, gb = getattr(args, "microbatches", None), getattr(args, "global_batch", None)
    if m is not None and gb is not None:
        raise PlanError("give --microbatches or --global-batch, not both")
    if gb is not None:
        per_step = s.dp * s.mbs
        if gb % per_step:
            raise PlanError(
                f"--global-batch {gb} is not a multiple of dp ({s.dp}) x mbs ({s.mbs}) = {per_step}"
            )
        m = gb // per_step
    if m is not None:
        s = dataclasses.replace(s, microbatches=m)
    if getattr(args, "no_sp", False):
        s = dataclasses.replace(s, sp=False)
    return s
