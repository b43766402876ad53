"""`hyperloom` command line: train, generate, model info, config show.

User errors (bad config, missing data, unusable checkpoint, unknown device) end with one
clear message on stderr and exit status 2, never a traceback; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import logging
import os
import sys
import typing

from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from hyperloom.checkpoint.hf import ConvertError, add_convert_parser
from hyperloom.config import ConfigError, JobConfig, dumps_toml, load_config, parse_overrides
from hyperloom.pipeline import ScheduleError
from hyperloom.pipeline.cli import add_schedule_parser
from hyperloom.planner import PlanError
from hyperloom.planner.cli import add_plan_parser
from hyperloom.resilience.drill import add_drill_parser
from hyperloom.resilience.lock import RunDirError
from hyperloom.resilience.watchdog import GAVE_UP_EXIT, RestartLoopError


class UsageError(ValueError):
    """A command-line argument outside what its command accepts (argparse checks the type)."""


# User errors whose modules load without torch: caught first, so a mistake in a config,
# a plan or a schedule is answered without importing it (see `_user_errors` for the rest).
USER_ERRORS: tuple[type[Exception], ...] = (
    UsageError,
    ConfigError,
    PlanError,
    ScheduleError,
    ConvertError,
    RunDirError,
)


def _report_user_error(args: argparse.Namespace, exc: Exception) -> int:
    where = f" (rank {_rank()})" if "RANK" in os.environ else ""
    print(f"hyperloom {args.command}{where}: error: {exc}", file=sys.stderr)
    return 2


def _user_errors() -> tuple[type[Exception], ...]:
    # Imported lazily so `hyperloom config show` (and any config error) does not pay for
    # torch-heavy modules: torch's import is 1.7 s of a 3 s `config` command.
    from hyperloom.accelerator import AcceleratorError
    from hyperloom.checkpoint import CheckpointError
    from hyperloom.data import DataError
    from hyperloom.inference import GenerationError
    from hyperloom.resilience.policy import TrainingHalted

    return (
        *USER_ERRORS,
        AcceleratorError,
        DataError,
        CheckpointError,
        GenerationError,
        TrainingHalted,
    )


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _setup_logging(verbose: bool) -> None:
    # Under torchrun only rank 0 narrates; the others speak up for warnings and errors.
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(
        level=level if _rank() == 0 else logging.WARNING,
        format="%(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(console=_console(stderr=True), show_path=False, markup=False)],
        force=True,
    )


def _split_config_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """CONFIG is optional; a first positional that starts with -- is an override."""
    overrides = list(args.overrides)
    if getattr(args, "run_dir", None):
        overrides += ["--logging.run_dir", args.run_dir]
    if getattr(args, "profile", None):
        overrides += ["--logging.profile", args.profile]
    return args.config, overrides


# ------------------------------------------------------------------------- commands


def _launch_torchrun(args: argparse.Namespace) -> int:
    """`hyperloom train --nproc N [--max-restarts R]` = torchrun on this machine with N
    processes, restarted after a failure (hyperloom.resilience.launch). The config is
    validated here first, against world size N, so a bad layout is reported once instead of
    by N processes."""
    from hyperloom.resilience.launch import launch

    config, overrides = _split_config_args(args)
    cfg = load_config(config, overrides, world_size=args.nproc)
    train_args = ([config] if config else []) + overrides
    return launch(train_args, cfg.logging.run_dir, args.nproc, args.max_restarts)


def _at_least(flag: str, value: int | None, least: int, what: str) -> None:
    if value is not None and value < least:
        raise UsageError(f"{flag} must be >= {least} ({what}), got {value}")


def cmd_train(args: argparse.Namespace) -> int:
    _at_least("--nproc", args.nproc, 1, "processes to start on this machine")
    _at_least("--max-restarts", args.max_restarts, 0, "restarts after a failure; 0 = none")
    if args.nproc > 1 or args.max_restarts > 0:
        return _launch_torchrun(args)
    from hyperloom.resilience.lock import hold_run_dir

    cfg = load_config(*_split_config_args(args))
    with hold_run_dir(cfg.logging.run_dir):
        return _train(cfg)


def _train(cfg: JobConfig) -> int:
    from hyperloom.inference import LoadedModel, complete
    from hyperloom.train.report import summary_table, write_summary
    from hyperloom.train.trainer import Trainer

    out = _console()
    trainer = Trainer(cfg)
    # the planner's self-check (a one-time calibration) waits until the result is shown
    result = trainer.run(defer_self_check=True)
    if not trainer.mesh.is_main:
        return 0
    summary = result.summary
    lg = cfg.logging
    if cfg.model.family == "vlm":  # held-out answers and a caption instead of a text sample
        if lg.eval_answers > 0 and summary.get("checkpoint"):
            _vlm_report(out, trainer, summary, result.run_dir)
    elif lg.sample_prompt and lg.sample_tokens > 0 and trainer.mesh.world_size == 1:
        loaded = LoadedModel(
            trainer.model, trainer.data.tokenizer, cfg, result.run_dir, trainer.acc
        )
        text, stats = complete(loaded, lg.sample_prompt, lg.sample_tokens, seed=cfg.train.seed)
        summary["sample"] = lg.sample_prompt + text
        out.rule("sample")
        out.print(lg.sample_prompt + text, markup=False, highlight=False)
        out.rule()
    trainer.add_self_check(summary)
    write_summary(result.run_dir, summary)
    out.print(summary_table(summary))
    out.print(
        f"run directory: {result.run_dir}  (metrics.jsonl, summary.json, loss_curve.png, "
        f"checkpoints/)"
    )
    return 0


def _vlm_report(out, trainer, summary: dict, run_dir) -> None:
    """A vlm's held-out accuracy and caption from its final checkpoint, loaded into this
    process whatever layout trained it (`inference.multimodal`)."""
    from hyperloom.inference import load_for_inference
    from hyperloom.inference.multimodal import vlm_report
    from hyperloom.train.report import write_summary

    n = min(trainer.cfg.logging.eval_answers, len(trainer.data.val))
    loaded = load_for_inference(summary["checkpoint"], device=trainer.cfg.train.device)
    with _progress_bar(out, "held-out answers", n) as advance:
        report = vlm_report(loaded, trainer.data.val, run_dir, n, advance)
    summary["vlm_eval"] = report
    write_summary(run_dir, summary)
    out.rule("held-out answers")
    for task, r in report["by_task"].items():
        out.print(f"{task:>14}: {r['accuracy']:6.1%}  (chance {r['chance']:5.1%}, n={r['n']})")
    out.print(
        f"{'all':>14}: {report['accuracy']:6.1%}  (chance {report['chance']:5.1%}, "
        f"n={report['n']}) in {report['seconds']:.1f} s"
    )
    cap = report["caption"]
    out.print(f"caption of a held-out scene: {cap['generated']!r}", markup=False)
    out.print(f"             its reference: {cap['reference']!r}", markup=False)
    out.print(f"plot: {report['plot']}")
    out.rule()


def _generate_with_images(args: argparse.Namespace, loaded) -> int:
    """`generate --image PATH [--image PATH ...]` on a vision-language checkpoint: the
    images padded square and resized as in training, the prompt in the training template."""
    from hyperloom.checkpoint import CheckpointError
    from hyperloom.data.multimodal.dataset import normalize_images
    from hyperloom.data.multimodal.llava import load_image
    from hyperloom.inference.multimodal import answer, image_prompt

    m = loaded.cfg.model
    if m.family != "vlm":
        raise CheckpointError(
            f"--image needs a vision-language checkpoint (model.family = 'vlm'); "
            f"{loaded.checkpoint} holds a '{m.family}' model"
        )
    if args.speculative:
        raise UsageError("--speculative drafts with MTP modules, which a vlm has none of")
    for path in args.image:
        if not os.path.isfile(path):
            raise UsageError(f"--image {path}: no such file")
    pictures = [load_image(path, m.image_size, "--image") for path in args.image]
    images = normalize_images(pictures, len(pictures), m.image_size) if pictures else None
    try:
        prompt = image_prompt(loaded, args.prompt, len(pictures))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    sampling.update(seed=args.seed, use_cache=not args.no_cache)
    print(answer(loaded, prompt, images, args.max_new_tokens, **sampling))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from hyperloom.inference import check_sampling, complete, load_for_inference

    problems = check_sampling(
        args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed
    )
    if problems:  # named as the flags, before minutes of loading a model
        name, message = problems[0]
        raise UsageError(f"--{name.replace('_', '-')} {message}")
    loaded = load_for_inference(args.checkpoint, device=args.device)
    if args.image or loaded.cfg.model.family == "vlm":
        return _generate_with_images(args, loaded)
    if args.speculative and loaded.cfg.model.mtp_depth == 0:
        from hyperloom.checkpoint import CheckpointError

        raise CheckpointError(
            f"--speculative drafts with the model's MTP modules, and {loaded.checkpoint} has "
            f"none (model.mtp_depth = 0)"
        )
    text, stats = complete(
        loaded,
        args.prompt,
        args.max_new_tokens,
        speculative=args.speculative,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        use_cache=not args.no_cache,
    )
    print(args.prompt + text)
    logging.getLogger("hyperloom.generate").info(
        "%d prompt tokens, %d new tokens in %.2f s (%.1f tokens/s, %s) from %s",
        stats["prompt_tokens"],
        stats["new_tokens"],
        stats["seconds"],
        stats["tokens_per_s"],
        "KV cache" if not args.no_cache else "no cache",
        loaded.checkpoint,
    )
    if args.speculative:
        logging.getLogger("hyperloom.generate").info(
            "speculative (MTP depth %d): acceptance rate %.3f (%d of %d drafted tokens), "
            "%.2f tokens per main-model forward (%d forwards)",
            loaded.cfg.model.mtp_depth,
            stats["acceptance_rate"],
            stats["accepted"],
            stats["drafted"],
            stats["tokens_per_forward"],
            stats["forwards"],
        )
    return 0


def cmd_model_info(args: argparse.Namespace) -> int:
    from hyperloom.config import preset_config, preset_names
    from hyperloom.models.registry import family

    _at_least("--seq", args.seq, 1, "tokens per sequence for the FLOPs")
    names = preset_names() if args.name == "all" else [args.name]
    table = Table(title="hyperloom models", title_style="bold")
    for col in (
        "preset",
        "parameters",
        "activated",
        "+ MTP",
        "layers",
        "dim",
        "heads/kv",
        "ffn",
        "vocab",
        f"train GFLOP/token @ seq {args.seq}",
    ):
        table.add_column(col, justify="left" if col == "preset" else "right")
    rows = []
    for name in names:
        try:
            cfg = preset_config(name)
        except KeyError as exc:
            raise ConfigError(str(exc.args[0])) from None
        fam = family(cfg.family)
        params, flops = fam.param_count(cfg), fam.training_flops_per_token(cfg, args.seq)
        # MoE: "parameters" is the main model (DeepSeek's published total, MTP apart) and
        # "activated" what one token uses; dense models use all of them.
        mtp = fam.mtp_param_count(cfg) if fam.mtp_param_count else 0
        params -= mtp
        active = fam.active_param_count(cfg) if fam.active_param_count else params
        rows.append(
            {
                "preset": name,
                "parameters": params,
                "activated_parameters": active,
                "mtp_parameters": mtp,
                "flops_per_token": flops,
                "seq_len": args.seq,
                **dataclasses.asdict(cfg),
            }
        )
        table.add_row(
            name,
            f"{params:,} ({_short(params)})",
            f"{active:,} ({_short(active)})",
            f"{mtp:,}" if mtp else "-",
            str(cfg.n_layers),
            str(cfg.dim),
            f"{cfg.n_heads}/{cfg.n_kv_heads}",
            f"{cfg.ffn_dim:,}",
            f"{cfg.vocab_size:,}",
            f"{flops / 1e9:,.2f}",
        )
    if args.json:
        print(json.dumps(rows if len(rows) > 1 else rows[0], indent=2))
    else:
        console = _console()
        console.print(table)
        console.print(
            "FLOPs: 6 x matmul weights + 12 x layers x seq x dim per token (Megatron/PaLM "
            "convention, full attention matrix); MoE: the top-k routed experts, MTP included. "
            "Activated: parameters one token uses, the input embedding lookup excluded."
        )
    return 0


def _short(n: int) -> str:
    """A parameter count as usually published: 671B, 37B, 2.4B, 8.0B, 21M."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value >= 10 else f"{value:.1f}{unit}"
    return str(n)


def _runtime_memory(micro_batch: int, policy: str) -> dict:
    """The trainer's memory probe for `plan calibrate`: the planner fits what our own
    training loop measures, and is handed it here because it never imports the trainer."""
    from hyperloom.train.probe import measure_runtime_memory

    return measure_runtime_memory(micro_batch, policy)


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from hyperloom.data.cli import prepare  # torch: only once the config is valid

    _at_least("--nproc", args.nproc, 1, "processes the layout is validated for")
    return prepare(load_config(*_split_config_args(args), world_size=args.nproc), _console())


def cmd_config_show(args: argparse.Namespace) -> int:
    _at_least("--nproc", args.nproc, 1, "processes the layout is validated for")
    cfg = load_config(*_split_config_args(args), world_size=args.nproc)
    print(dumps_toml(cfg), end="")
    return 0


# ------------------------------------------------------------------------- parser


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="TOML job file (default: the built-in tiny job)")
    p.add_argument("--run-dir", help="directory for this run (= --logging.run_dir)")
    p.set_defaults(accepts_overrides=True)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (exit status 2) instead of the usage text."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hyperloom",
        description="Train and run large transformer models. Config keys can be overridden "
        "as --section.key value (e.g. --train.steps 200).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a model (default: tiny Llama on the Python stdlib)")
    _add_config_args(p)
    p.add_argument(
        "--nproc", type=int, default=1, help="start N processes on this machine via torchrun"
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="torchrun restarts of the process group after a failure or a watchdog exit; "
        "each resumes from the newest committed checkpoint",
    )
    p.add_argument(
        "--profile",
        metavar="STEPS",
        help="profile these training steps, START-END or STEP (= --logging.profile): "
        "Chrome traces in RUN_DIR/profile (docs/tracking.md)",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("generate", help="generate text from a checkpoint")
    p.add_argument("--checkpoint", required=True, help="checkpoint or run directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute instead of a KV cache")
    p.add_argument(
        "--speculative",
        action="store_true",
        help="draft with the model's MTP modules, verify with the model (DeepSeek, mtp_depth > 0)",
    )
    p.add_argument(
        "--image",
        action="append",
        default=[],
        help="an image for a vision-language checkpoint, once per <image> in the prompt "
        "(prepended where the prompt has none)",
    )
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_generate)

    add_convert_parser(sub)
    p = sub.add_parser("model", help="model registry")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    q = msub.add_parser("info", help="exact parameter count and training FLOPs per token")
    q.add_argument("name", nargs="?", default="all", help="preset name (default: all)")
    q.add_argument("--seq", type=int, default=8192, help="sequence length for FLOPs")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_model_info)

    add_schedule_parser(sub)
    add_plan_parser(sub, runtime_memory=_runtime_memory)
    add_drill_parser(sub)

    p = sub.add_parser("data", help="data caches")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    q = dsub.add_parser(
        "prepare", help="read, split and tokenize a job's corpus into its cache ahead of training"
    )
    _add_config_args(q)
    q.add_argument("--nproc", type=int, default=None, help="validate for N processes")
    q.set_defaults(func=cmd_data_prepare)

    p = sub.add_parser("config", help="configuration")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    q = csub.add_parser("show", help="print the resolved config as TOML")
    _add_config_args(q)
    q.add_argument("--nproc", type=int, default=None, help="validate for N processes")
    q.set_defaults(func=cmd_config_show)
    return parser


def _take_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split `--section.key value` / `--section.key=value` tokens from argparse's arguments."""
    rest, overrides, i = [], [], 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--") and "." in tok.split("=", 1)[0]:
            overrides.append(tok)
            if "=" not in tok and i + 1 < len(argv):
                overrides.append(argv[i + 1])
                i += 1
        else:
            rest.append(tok)
        i += 1
    return rest, overrides


@contextlib.contextmanager
def _progress_bar(out: Console, what: str, total: int):
    """A progress bar for `total` items of long work; yields advance(done)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        f"[bold]{what}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=out
    ) as bar:
        task = bar.add_task(what, total=total)
        yield lambda done: bar.update(task, completed=done)


def _console(stderr: bool = False) -> Console:
    """stdout console; wide tables stay readable when piped (rich assumes 80 columns)."""
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=160)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv, overrides = _take_overrides(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if overrides and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    args.overrides = overrides
    _setup_logging(args.verbose)
    if "RANK" in os.environ:
        faulthandler.enable()  # a rank killed by a signal still shows where it was
    try:
        parse_overrides(args.overrides)  # syntax errors surface before any work
        rc = args.func(args)
    except RestartLoopError as exc:
        # Leave successfully under torchrun, or it would restart again; `train` reports it.
        print(f"hyperloom {args.command} (rank {_rank()}): gave up: {exc}", file=sys.stderr)
        rc = 0 if "TORCHELASTIC_RESTART_COUNT" in os.environ else GAVE_UP_EXIT
    except USER_ERRORS as exc:  # before the others, which import torch to be named
        rc = _report_user_error(args, exc)
    except _user_errors() as exc:
        rc = _report_user_error(args, exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        rc = 130
    except RuntimeError as exc:
        if not lost_peer(exc):
            raise
        print(lost_peer_line(args.command, exc), file=sys.stderr)
        rc = 1  # not a user error: the launcher may restart the group
    return _leave(rc)


# What a collective raises on a rank whose peer died (gloo says so in its message; NCCL's
# errors are torch.distributed.DistError).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc`, in a torchrun worker, is a collective failing because another rank of
    the job died: that rank's own line and the launcher's say why, so this rank's traceback
    would only bury them."""
    if "RANK" not in os.environ:
        return False
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", ())
    return isinstance(exc, dist_error) or any(s in str(exc) for s in _PEER_GONE)


def lost_peer_line(command: str, exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (
        f"hyperloom {command} (rank {_rank()}): stopped: another rank of the job is gone "
        f"({first[:160]}); the launcher's line says which"
    )


def _leave(rc: int) -> int:
    """A torchrun worker leaves through `exit_worker` (see there); otherwise returns rc."""
    if "torch" not in sys.modules:  # nothing imported torch: no process group to leave
        return rc
    from hyperloom.parallel.mesh import exit_worker

    return exit_worker(rc)


if __name__ == "__main__":
    raise SystemExit(main())
