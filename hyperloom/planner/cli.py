"""`hyperloom plan`: predict one layout, search the layouts, or calibrate this machine.

    hyperloom plan predict CONFIG.toml [--section.key value ...] [--schedule K --vpp V
                   --recompute R --fp8 --dispatcher D --cp-comm C] [--gpus N]
    hyperloom plan predict --model llama3-70b [--layers 20] --tp 8 --pp 2 --dp 4 --mbs 1
                   --microbatches 16 --seq 8192 [--dim/--heads/--kv-heads/--ffn/--vocab ...]
    hyperloom plan search --model llama3-70b --gpus 1024 --accelerator h100
                   --global-batch 1024 --seq 8192 [--top 10] [--fix tp=8,pp=4/8]
    hyperloom plan search CONFIG.toml [--section.key value ...] [--fix ...]
    hyperloom plan calibrate [--out profile.json] [--quick] [--dtype fp32]

`predict` reads the same TOML (and dotted overrides) as `hyperloom train`, takes the layout
from [parallel], the micro-batch size and count from [train] and the sequence length from
[data] (`Strategy.from_job`), and predicts that one layout; the schedule kind, chunks per
rank, recompute policy (train.recompute) and FP8 come from the job unless a flag says
otherwise. The config is read without the trainer's "not built yet" checks, so
layouts the trainer cannot run yet can be planned. Without a CONFIG, flags describe the job
(`flags.py`: a preset or a shape, the layout, micro-batches, sequence length). The prediction
is the realistic one; the roofline (every efficiency 1) is shown beside it as a
bound. `search` searches the layouts of a model preset, or of a job's model, GPU count and
batch (`search.py`); --fix pins dimensions (``/``
separates several values). --json writes every plan, --png-prefix writes PREFIX_memory.png,
PREFIX_timeline.png and (search) PREFIX_top.png. `calibrate` measures this machine
(`calibrate.py`) and saves a profile that --accelerator accepts. Without a subcommand,
`hyperloom plan CONFIG` predicts (or searches, with --search) and `hyperloom plan --model ...`
searches.

This docstring's third paragraph (the one above) is `hyperloom plan --help`'s description.
`add_plan_parser(subparsers, runtime_memory)` registers the command; `runtime_memory` is the
trainer's memory probe that `calibrate` fits on. `PlanError` is its user error.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from rich.console import Console

from hyperloom.config.args import number
from hyperloom.planner.errors import PlanError
from hyperloom.planner.flags import add_job_flags, apply_layout, has_job_flags, job_overrides
from hyperloom.planner.hardware import PROFILES, Cluster, get_profile
from hyperloom.planner.host_memory import RuntimeMemoryProbe
from hyperloom.planner.strategy import RUNTIMES

log = logging.getLogger("hyperloom.planner")

_FIXABLE = {
    "tp": int,
    "pp": int,
    "cp": int,
    "cp_comm": str,  # context-parallel attention: ring or alltoall
    "mbs": int,
    "zero": int,
    "vpp": int,
    "schedule": str,
    "recompute": str,
    "fp8": "bool",
    "ep": int,
    "dispatcher": str,  # EP token dispatch: alltoall or allgather
    "etp": int,  # routed experts' width split over etp ranks of tp (0 = tp)
}
MODES = ("predict", "search", "calibrate")


class _AnyName(Mapping):
    """The subcommands by name (a view of `names`), letting any first positional through
    argparse's choice check: a name that is no subcommand is a job CONFIG (`_Modes`)."""

    def __init__(self, names: dict[str, argparse.ArgumentParser]) -> None:
        self.names = names

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        return self.names[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return True


class _Modes(argparse._SubParsersAction):
    """The subcommands, where a first positional that names none is a job CONFIG for the
    `plan` parser's own options (`hyperloom plan CONFIG ...`, as before the subcommands)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choices = _AnyName(self._name_parser_map)

    def __call__(self, parser, namespace, values, option_string=None):
        if values[0] in MODES:
            return super().__call__(parser, namespace, values, option_string)
        namespace.target = values[0]
        _, rest = parser.parse_known_args(values[1:], namespace)
        if rest:  # left to the top-level parser, which reports them
            vars(namespace).setdefault(argparse._UNRECOGNIZED_ARGS_ATTR, []).extend(rest)
        return None


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--accelerator",
        default="h100",
        help=f"{', '.join(PROFILES)} or a calibrated .json profile",
    )
    p.add_argument("--gpus-per-node", type=number(int, least=1), help="default: the profile's (8)")
    p.add_argument("--intra-gbs", type=number(above=0), help="scale-up GB/s per GPU per direction")
    p.add_argument("--inter-gbs", type=number(above=0), help="scale-out (NIC) GB/s per GPU")


def _runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runtime",
        choices=list(RUNTIMES),
        default="hyperloom",
        help="whose storage and overlap behaviour to model",
    )
    p.add_argument(
        "--param-dtype",
        choices=["fp32", "bf16"],
        help="bf16 = Megatron's layout (BF16 params, FP32 main grads + master)",
    )
    p.add_argument(
        "--efficiency",
        type=float,
        help="a further factor on every compute rate beyond the profile's step_eff "
        "(default 1: the profile's realistic rates)",
    )
    p.add_argument(
        "--margin-gib", type=number(least=0), default=6.0, help="memory kept free per device"
    )


def _search_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--global-batch", type=int, help="sequences per optimizer step (a CONFIG keeps its own)"
    )
    p.add_argument("--top", type=number(int, least=1), default=10, help="plans to keep")
    p.add_argument("--fix", default="", help="pin dimensions: tp=8,pp=4/8,schedule=1f1b,...")


def _layout_args(p: argparse.ArgumentParser, mode: str = "") -> None:
    """The flags that change a job's layout (prefixed with `mode` in the plain `plan` help)."""
    p.add_argument("--schedule", default=None, help=f"{mode}schedule kind (default: the job's)")
    p.add_argument("--vpp", type=number(int, least=1), default=None, help=f"{mode}chunks per rank")
    p.add_argument(
        "--recompute",
        default=None,
        help=f"{mode}none, selective, full or core_attn,mlp_act,norm (default: the job's "
        "train.recompute, or none)",
    )
    p.add_argument("--fp8", action="store_true", help=f"{mode}FP8 GEMMs")
    p.add_argument(
        "--dispatcher",
        choices=["alltoall", "allgather"],
        default=None,
        help=f"{mode}expert-parallel token dispatch (default alltoall)",
    )
    p.add_argument(
        "--cp-comm",
        choices=["ring", "alltoall"],
        default=None,
        help=f"{mode}how attention crosses the context-parallel ranks (default: the job's "
        "parallel.cp_comm)",
    )
    p.add_argument(
        "--moe-imbalance",
        type=number(least=1),
        default=None,
        help=f"{mode}tokens the busiest expert-parallel rank receives over the mean "
        "(default 1.25; 1 = perfectly balanced routing)",
    )


def _vision_args(p: argparse.ArgumentParser) -> None:
    """A vision-language model's (family vlm) images and frozen parts."""
    p.add_argument(
        "--images-per-sample",
        type=number(least=0),
        default=None,
        help="vlm: images each sequence carries (default 1, as models.vlm.accounting assumes; "
        "data.max_images is a cap, not a count)",
    )
    p.add_argument(
        "--freeze",
        default=None,
        help="vlm: frozen parts, e.g. vision or vision,decoder (default: the job's "
        "train.freeze, or none)",
    )


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", help="write the plans as JSON")
    p.add_argument("--png-prefix", metavar="PREFIX", help="write memory/timeline/top-k PNGs")


def _calibrate_args(p: argparse.ArgumentParser, mode: str = "") -> None:
    p.add_argument("--out", default="hyperloom-profile.json", help=f"{mode}output file")
    p.add_argument("--quick", action="store_true", help=f"{mode}fewer shapes and sizes")
    p.add_argument(
        "--host-allocator",
        choices=["cache", "system"],
        default="cache",
        help=f"{mode}on CPU, the training runs' train.host_allocator policy",
    )
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help=f"{mode}the training runs' precision.dtype (the GEMMs and kernels measured in it)",
    )
    p.add_argument(
        "--job",
        metavar="CONFIG",
        help=f"{mode}also time this job's own GEMM shapes, each training form (and its "
        "--section.key overrides)",
    )


def add_plan_parser(
    subparsers: Any, runtime_memory: RuntimeMemoryProbe | None = None
) -> argparse.ArgumentParser:
    """Register `plan` and its subcommands on an argparse sub-parser collection; returns the
    `plan` parser. `runtime_memory` goes to `calibrate` (see the module docstring)."""
    paragraphs = __doc__.split("\n\n")
    p = subparsers.add_parser(
        "plan",
        help="predict step time, memory and MFU of a layout, or search for the best ones",
        description=paragraphs[2],
    )
    # `hyperloom plan [CONFIG] ...` without a subcommand: every flag, as before
    p.add_argument("--model", help="model preset to search layouts for (e.g. llama3-70b)")
    p.add_argument("--gpus", type=number(int, least=1), help="number of accelerators")
    p.add_argument(
        "--seq", type=number(int, least=1), help="sequence length (default: config's, or 4096)"
    )
    _search_args(p)
    _cluster_args(p)
    _runtime_args(p)
    _layout_args(p, "CONFIG mode: ")
    p.add_argument("--search", action="store_true", help="CONFIG mode: search instead")
    _vision_args(p)
    _output_args(p)
    _calibrate_args(p, "calibrate: ")
    handler = functools.partial(cmd_plan, runtime_memory=runtime_memory)
    p.set_defaults(func=handler, accepts_overrides=True, target=None)

    modes = p.add_subparsers(
        dest="plan_command", action=_Modes, metavar="{predict,search,calibrate}"
    )
    q = modes.add_parser(
        "predict",
        help="one layout: a job config's (the same TOML and overrides as `hyperloom train`) "
        "or one given by flags (--model/--dim ..., --tp/--pp/--dp ...)",
        description=paragraphs[2].split(" `search` ")[0],
    )
    q.add_argument(
        "target", nargs="?", metavar="CONFIG", help="job TOML ([--section.key value] overrides)"
    )
    add_job_flags(q)
    q.add_argument(
        "--gpus", type=number(int, least=1), help="number of accelerators (default: the job's)"
    )
    q.add_argument("--seq", type=number(int, least=1), help="sequence length (default: the job's)")
    _layout_args(q)
    _cluster_args(q)
    _runtime_args(q)
    _vision_args(q)
    _output_args(q)

    q = modes.add_parser(
        "search",
        help="the fastest layouts that fit, for a model preset or a job config",
        description="Search tp, pp (and chunks), dp, cp, ep, ZeRO, micro-batches, schedule, "
        "recompute and FP8 for the fastest layouts that fit (`planner/search.py`).",
    )
    q.add_argument("target", nargs="?", metavar="CONFIG", help="job TOML (instead of --model)")
    q.add_argument("--model", help="model preset (e.g. llama3-70b)")
    q.add_argument(
        "--gpus", type=number(int, least=1), help="number of accelerators (default: the job's)"
    )
    q.add_argument(
        "--seq", type=number(int, least=1), help="sequence length (default: the job's, or 4096)"
    )
    _search_args(q)
    _cluster_args(q)
    _runtime_args(q)
    _vision_args(q)
    _output_args(q)

    q = modes.add_parser(
        "calibrate",
        help="measure this machine and save a profile that --accelerator accepts",
        description="Measure this machine's kernels, memory and collectives as a training "
        "step runs them, and save a hardware profile (`planner/calibrate.py`).",
    )
    _calibrate_args(q)
    return p


def parse_fix(text: str) -> dict[str, Any]:
    """'tp=8,pp=4/8,fp8=true' -> {'tp': (8,), 'pp': (4, 8), 'fp8': (True,)}."""
    out: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _FIXABLE:
            raise PlanError(f"--fix {item!r}: expected NAME=VALUE with NAME in {sorted(_FIXABLE)}")
        kind = _FIXABLE[key]
        vals = []
        for v in value.split("/"):
            try:
                if kind == "bool":
                    vals.append(v.strip().lower() in ("1", "true", "yes", "on"))
                else:
                    vals.append(kind(v.strip()))
            except ValueError:
                raise PlanError(f"--fix {key}: {v!r} is not a {kind.__name__}") from None
        out[key] = tuple(vals)
    return out


def load_job(path: str | None, overrides: list[str]):
    """The job TOML plus overrides as a `JobConfig`, *without* the trainer's validation."""
    from hyperloom.config import (
        ConfigError,
        JobConfig,
        build_section,
        parse_overrides,
        preset_values,
        read_toml,
    )

    raw = read_toml(path) if path else {}
    for section, values in parse_overrides(overrides).items():
        raw.setdefault(section, {}).update(values)
    model_raw = dict(raw.get("model", {}))
    if "preset" in model_raw:
        try:
            model_raw = {**preset_values(str(model_raw["preset"])), **model_raw}
        except KeyError as exc:
            raise ConfigError(f"model.preset: {exc.args[0]}") from None
    sections = typing.get_type_hints(JobConfig)
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ConfigError(f"unknown sections {unknown}; sections are {', '.join(sections)}")
    built = {
        name: build_section(cls, model_raw if name == "model" else raw.get(name, {}), name)
        for name, cls in sections.items()
    }
    return JobConfig(**built)


def _cluster(args: argparse.Namespace, gpus: int) -> Cluster:
    acc = get_profile(args.accelerator)
    changes = {}
    if args.intra_gbs:
        changes["intra_gbs"] = args.intra_gbs
    if args.inter_gbs:
        changes["nic_gbs"] = args.inter_gbs
    acc = dataclasses.replace(acc, **changes) if changes else acc
    return Cluster(acc, gpus, args.gpus_per_node or acc.gpus_per_node)


def _runtime(args: argparse.Namespace):
    rt = RUNTIMES[args.runtime]
    if args.param_dtype:
        rt = rt.with_param_dtype(args.param_dtype)
    if args.efficiency:
        if not 0 < args.efficiency <= 1:
            raise PlanError(f"--efficiency must lie in (0, 1], got {args.efficiency}")
        rt = dataclasses.replace(rt, efficiency=args.efficiency)
    return rt


def _auto_recompute(job, args: argparse.Namespace, plan_of, profile):
    """The job's `train.recompute = auto`, chosen as the trainer chooses it
    (planner.autorecompute), against `train.memory_budget_gb` or the profile's memory less
    --margin-gib, from this command's own predictions. Stages that choose differently are
    predicted as the costliest one's uniform plan, as the trainer's self-check does."""
    from hyperloom.planner.autorecompute import choose_recompute

    budget = job.train.memory_budget_gb * 1e9
    if not budget:
        budget = (profile.hbm_gib - args.margin_gib) * 2**30
    return choose_recompute(plan_of, profile, budget)


def _imbalanced(spec, args: argparse.Namespace):
    """The model with --moe-imbalance, where given."""
    if args.moe_imbalance is None:
        return spec
    return dataclasses.replace(spec, moe_imbalance=args.moe_imbalance)


def _with_vision(spec, args: argparse.Namespace):
    """The model with --images-per-sample and --freeze, where given."""
    changes: dict[str, Any] = {}
    if getattr(args, "images_per_sample", None) is not None:
        changes["images_per_sample"] = args.images_per_sample
    if getattr(args, "freeze", None) is not None:
        changes["freeze"] = tuple(p.strip() for p in args.freeze.split(",") if p.strip())
    if changes and not spec.vision:
        raise PlanError("--images-per-sample and --freeze apply to a vlm (model.family = 'vlm')")
    return dataclasses.replace(spec, **changes) if changes else spec


def _console() -> Console:
    probe = Console()
    return probe if probe.is_terminal else Console(width=170)


def cmd_plan(args: argparse.Namespace, runtime_memory: RuntimeMemoryProbe | None = None) -> int:
    """`hyperloom plan`: the subcommand, or without one the mode the arguments imply."""
    mode = args.plan_command or ("predict" if args.target and not args.search else "search")
    if mode == "calibrate":
        from hyperloom.planner.calibrate import cmd_calibrate

        return cmd_calibrate(args, runtime_memory)
    from hyperloom.config import is_auto, preset_config
    from hyperloom.planner import report
    from hyperloom.planner.model import ModelSpec
    from hyperloom.planner.search import SearchSpace, search
    from hyperloom.planner.simulate import predict, with_roofline
    from hyperloom.planner.strategy import Strategy

    out, rt = _console(), _runtime(args)
    fixes = parse_fix(args.fix)
    flagged = args.plan_command == "predict"  # flags may describe (or change) the job
    if args.target or flagged:
        overrides = list(getattr(args, "overrides", []) or [])
        if flagged:
            if not args.target and not has_job_flags(args):
                raise PlanError(
                    "plan predict needs a job CONFIG or the model as flags: --model PRESET "
                    "and/or --dim, --layers, --heads, ... (see hyperloom plan predict --help)"
                )
            overrides = job_overrides(args) + overrides
        job = load_job(args.target, overrides)
        if job.precision.dtype != "bf16":
            log.warning("precision.dtype = %s: the planner costs BF16 compute", job.precision.dtype)
        spec = _with_vision(_imbalanced(ModelSpec.from_job(job), args), args)
        fp8 = True if args.fp8 else None
        recompute = args.recompute
        auto = recompute is None and is_auto(job.train.recompute)
        s = Strategy.from_job(job, args.schedule, args.vpp, "none" if auto else recompute, fp8)
        if flagged:
            s = apply_layout(s, args)
        if args.dispatcher:
            s = dataclasses.replace(s, dispatcher=args.dispatcher)
        if args.cp_comm:
            s = dataclasses.replace(s, cp_comm=args.cp_comm)
        seq, gpus, gbs = args.seq or job.data.seq_len, args.gpus or s.world, s.global_batch
        if auto:  # the policy the trainer will choose, from this command's own model
            cluster = _cluster(args, gpus)

            def plan_of(policy: str, s=s):
                s = dataclasses.replace(s, recompute=policy)
                return predict(spec, cluster, s, seq, rt, args.margin_gib)

            choice = _auto_recompute(job, args, plan_of, cluster.profile)
            out.print(choice.describe())
            s = dataclasses.replace(s, recompute=choice.costliest)
    else:
        if not args.model:
            raise PlanError("give a job CONFIG to predict, or --model PRESET to search")
        try:
            spec = _imbalanced(
                ModelSpec.from_model_config(preset_config(args.model), args.model), args
            )
            spec = _with_vision(spec, args)
        except KeyError as exc:
            raise PlanError(str(exc.args[0])) from None
        if not args.gpus or not args.global_batch:
            raise PlanError("searching needs --gpus N and --global-batch B (sequences)")
        s, seq, gpus, gbs = None, args.seq or 4096, args.gpus, args.global_batch
    cluster = _cluster(args, gpus)
    query = {
        "model": spec.name,
        "gpus": gpus,
        "accelerator": cluster.profile.name,
        "gpus_per_node": cluster.gpus_per_node,
        "global_batch": gbs,
        "seq": seq,
        "runtime": rt.name,
        "param_bytes": rt.param_bytes,
        "efficiency": rt.efficiency,
        "moe_imbalance": spec.moe_imbalance if spec.n_routed_experts else None,
    }
    if spec.vision:
        query["images_per_sample"] = spec.images_per_sample
        query["freeze"] = list(spec.freeze)
    stats = None
    if mode == "predict":
        plans = [with_roofline(predict(spec, cluster, s, seq, rt, args.margin_gib), fast=False)]
        out.print(report.plans_table(plans, f"{spec.name} on {gpus} x {cluster.profile.name}"))
    else:
        result = search(
            spec, cluster, gbs, seq, rt, SearchSpace().fixed(**fixes), args.top, args.margin_gib
        )
        plans, stats = [with_roofline(p) for p in result.top], result.summary()
        out.print(
            report.plans_table(
                plans,
                f"top {len(plans)}: {spec.name} on {gpus} x {cluster.profile.name}, "
                f"batch {gbs} x {seq}, runtime {rt.name}",
            )
        )
        out.print(
            f"searched {result.enumerated:,} points in {result.seconds:.2f} s "
            f"({result.configs_per_s:,.0f}/s): {result.valid:,} valid, "
            f"{result.rejected.get('over memory', 0):,} over memory, "
            f"{result.rejected.get('bounded out (time)', 0):,} bounded out, "
            f"{result.simulated} replayed on the schedule IR"
        )
    for table in report.breakdown_table(plans[0]):
        out.print(table)
    out.print(report.roofline_note(plans[0]))
    if not plans[0].fits:
        out.print(
            f"[bold red]does not fit[/]: reserved {plans[0].reserved_memory / 2**30:.1f} "
            f"GiB > usable {plans[0].capacity / 2**30:.1f} GiB"
        )
    if args.json:
        out.print(f"wrote {report.write_json(args.json, query, plans, stats)}")
    if args.png_prefix:
        pre = args.png_prefix
        paths = [
            report.plot_memory(plans[0], f"{pre}_memory.png"),
            report.plot_timeline(plans[0], f"{pre}_timeline.png"),
        ]
        if len(plans) > 1:
            paths.append(report.plot_top(plans, f"{pre}_top.png"))
        out.print("wrote " + ", ".join(map(str, paths)))
    return 0
