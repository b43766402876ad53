"""Typed job configuration: nested dataclasses, TOML presets and dotted command-line overrides.

A job is one `JobConfig` made of sections (model, parallel, precision, train, data, checkpoint,
logging). Every field carries a one-line doc in its metadata; `hyperloom config show` prints
the resolved config as TOML with those docs as comments.

Loading happens in three layers, each a plain dict merge before any dataclass exists:

1. the dataclass defaults (which are the default job: the `tiny` model on the built-in corpus);
2. `model.preset`, if given, replaces the model section's defaults with that preset's values;
3. the TOML file, then the `--section.key value` overrides, in order.

Only then are the dataclasses built. Unknown keys, wrong types and values outside a field's
choices are reported with the key's full dotted name; `validate` then checks cross-field
consistency and shows the arithmetic. Nothing is mutated after construction: a `JobConfig`
that passed `load_config` is the job.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration problem the user can fix; `problems` lists each one."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


def knob(default: Any = dataclasses.MISSING, doc: str = "", *, factory=None, choices=None):
    """A config field with its one-line doc and, optionally, the values it accepts."""
    meta = {"doc": doc, "choices": tuple(choices) if choices else None}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the model. The defaults are the `tiny` preset."""

    preset: str = knob("tiny", "preset from the model registry; keys set here override it")
    family: str = knob("llama", "model family in the registry", choices=["llama", "deepseek"])
    vocab_size: int = knob(16384, "vocabulary size (the built-in tokenizer is trained to it)")
    dim: int = knob(384, "model width (hidden size)")
    n_layers: int = knob(6, "number of transformer blocks")
    n_heads: int = knob(6, "attention (query) heads")
    n_kv_heads: int = knob(2, "key/value heads for grouped-query attention")
    ffn_dim: int = knob(1024, "SwiGLU hidden width")
    norm_eps: float = knob(1e-5, "RMSNorm epsilon")
    rope_theta: float = knob(10000.0, "RoPE base frequency")
    rope_scaling: float = knob(1.0, "Llama-3.1 RoPE frequency scaling factor (1 = none)")
    rope_low_freq_factor: float = knob(1.0, "Llama-3.1 RoPE low-frequency factor")
    rope_high_freq_factor: float = knob(4.0, "Llama-3.1 RoPE high-frequency factor")
    rope_original_max_seq: int = knob(8192, "context length the RoPE scaling extends from")
    max_seq_len: int = knob(2048, "longest sequence the RoPE tables are built for")
    tie_embeddings: bool = knob(False, "share the input embedding with the output head")
    qk_norm: bool = knob(
        False, "RMSNorm on each head's query and key before RoPE (OLMo 2 / Qwen3); llama only"
    )
    init_std: float = knob(0.02, "std of the normal weight init (output projections scaled)")
    dropout: float = knob(
        0.0, "training dropout on attention weights and each block's residual branches (0 = off)"
    )
    # Mixture-of-Experts, MLA and MTP (family 'deepseek'; hyperloom.models.deepseek).
    n_routed_experts: int = knob(0, "MoE routed experts per MoE layer (0 = dense model)")
    n_shared_experts: int = knob(0, "MoE shared experts (one SwiGLU of n x moe_ffn_dim)")
    moe_top_k: int = knob(0, "routed experts per token")
    moe_ffn_dim: int = knob(0, "SwiGLU hidden width of one expert")
    n_dense_layers: int = knob(0, "the first k layers use the dense ffn_dim SwiGLU, not MoE")
    moe_score: str = knob(
        "softmax", "router scores: softmax (V2) or sigmoid (V3)", choices=["softmax", "sigmoid"]
    )
    moe_n_groups: int = knob(1, "expert groups for group-limited routing (1 = off)")
    moe_topk_groups: int = knob(1, "groups a token may route to")
    moe_norm_topk: bool = knob(True, "renormalise the top-k gate weights to sum to one")
    moe_route_scale: float = knob(1.0, "routed scaling factor on the gate weights")
    moe_capacity_factor: float = knob(
        0.0, "expert capacity factor, tokens over it dropped (0 = dropless)"
    )
    moe_bias_rate: float = knob(0.0, "aux-loss-free balancing bias step gamma (0 = off)")
    moe_seq_aux_alpha: float = knob(0.0, "sequence-wise balance loss weight alpha (0 = off)")
    moe_aux_alpha: float = knob(0.0, "batch-wise (Switch/GShard) balance loss weight (0 = off)")
    moe_z_loss: float = knob(0.0, "router z-loss weight (0 = off)")
    q_lora_rank: int = knob(0, "MLA low-rank query width (0 = plain query projection)")
    kv_lora_rank: int = knob(0, "MLA compressed key/value width (the cached latent)")
    qk_nope_head_dim: int = knob(0, "MLA per-head query/key width without RoPE")
    qk_rope_head_dim: int = knob(0, "MLA decoupled RoPE width (one key shared by all heads)")
    v_head_dim: int = knob(0, "MLA per-head value width")
    yarn_beta_fast: float = knob(
        32.0, "YaRN ramp end (rotations); deepseek uses rope_scaling as YaRN factor"
    )
    yarn_beta_slow: float = knob(1.0, "YaRN ramp start (rotations)")
    yarn_mscale: float = knob(1.0, "YaRN attention-scale coefficient (mscale_all_dim)")
    mtp_depth: int = knob(0, "multi-token prediction modules D (0 = off)")
    mtp_loss_weight: float = knob(0.3, "MTP loss weight lambda; each module's loss gets lambda / D")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout. Their product must equal the world size."""

    dp: int = knob(1, "data-parallel degree")
    tp: int = knob(1, "tensor-parallel degree")
    pp: int = knob(1, "pipeline-parallel degree")
    cp: int = knob(1, "context-parallel degree")
    ep: int = knob(1, "expert-parallel degree: each rank holds E / ep experts (folds over dp)")
    ep_dispatcher: str = knob(
        "alltoall",
        "how tokens reach their experts under ep: all-to-all of the routed rows, or "
        "all-gather of the group's rows + reduce-scatter of the outputs",
        choices=["alltoall", "allgather"],
    )
    sp: bool = knob(False, "sequence parallel: split norms/residuals along the sequence over tp")
    zero: int = knob(
        0,
        "0 = DDP; 1 = Adam state + master weights sharded over dp; 3 = FSDP2 (all sharded)",
        choices=[0, 1, 3],
    )
    order: str = knob("pp,dp,cp,tp", "rank order of the mesh, outermost first (tp innermost)")
    pp_schedule: str = knob(
        "1f1b",
        "pipeline schedule (`hyperloom schedule --help` describes each)",
        choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe", "dualpipev"],
    )
    vpp: int = knob(1, "model chunks per pipeline rank for 'interleaved' (zb-v/dualpipev imply 2)")
    microbatches: int = knob(
        0,
        "pipeline micro-batches per step, each train.micro_batch_size sequences (0 = 2 x pp)",
    )
    pp_layers: list[int] = knob(
        doc="layers per model chunk in pipeline order (empty = even split); a 0 gives the "
        "embedding or the head a chunk of its own",
        factory=list,
    )


@dataclass(frozen=True)
class PrecisionConfig:
    """Numeric formats."""

    dtype: str = knob(
        "bf16",
        "compute dtype; master weights and optimizer state stay fp32",
        choices=["bf16", "fp32"],
    )
    fp8: str = knob(
        "none",
        "FP8 GEMMs in linear layers: none, or the scaling recipe (see hyperloom.engine.fp8)",
        choices=["none", "delayed", "current", "rowwise", "blockwise", "mxfp8"],
    )
    fp8_keep: list[str] = knob(
        doc="module path patterns (fnmatch) whose linears stay in high precision under fp8",
        factory=lambda: [
            "tok_embeddings",
            "*embed*",
            "output",
            "lm_head",
            "*router*",
            "*.gate",
            "*norm*",
        ],
    )
    fp8_high_precision: list[str] = knob(
        doc="GEMMs of every FP8 linear run in high precision instead: fprop, dgrad, wgrad "
        "(TE's override_linear_precision; ['wgrad'] is Megatron's --no-fp8-wgrad)",
        factory=list,
    )
    fp8_activation: bool = knob(
        False,
        "under fp8, every FP8 linear (and MoE expert) saves the FP8 copy of its input for "
        "backward, 1 byte per element instead of the high-precision input, as DeepSeek-V3 "
        "caches activations; blockwise, MXFP8 and rowwise re-tile it for the weight "
        "gradient, a second rounding (current and delayed keep only the FP8 copy anyway "
        "whenever their weight-gradient GEMM is FP8)",
    )
    fp8_bf16_first_layers: int = knob(
        0,
        "under fp8, the first N transformer blocks keep every linear in high precision "
        "(Megatron's --first-last-layers-bf16 with --num-layers-at-start-in-bf16)",
    )
    fp8_bf16_last_layers: int = knob(
        0,
        "under fp8, the last N transformer blocks keep every linear in high precision "
        "(Megatron's --num-layers-at-end-in-bf16)",
    )


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
    host_allocator: str = knob(
        "cache",
        "CPU runs: glibc malloc keeps freed memory for reuse, as a caching allocator does "
        "(cache), or is left as it is (system); see hyperloom.accelerator",
        choices=["cache", "system"],
    )


@dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and packing."""

    source: str = knob(
        "stdlib",
        "stdlib = the running Python's standard library source; or text / jsonl files",
        choices=["stdlib", "text", "jsonl"],
    )
    paths: list[str] = knob(doc="files or directories for source text/jsonl", factory=list)
    text_field: str = knob("text", "JSONL field holding the document text")
    tokenizer: str = knob("", "path to a tokenizer.json; empty = built-in BPE trained and cached")
    eos_token: str = knob("<|endoftext|>", "token that separates documents")
    seq_len: int = knob(256, "tokens per training sequence")
    val_fraction: float = knob(0.02, "fraction of documents held out for validation")
    max_corpus_mb: float = knob(0.0, "use a deterministic subset of about this many MB (0 = all)")
    cache_dir: str = knob(
        "", "tokenizer/token cache; empty = $HYPERLOOM_CACHE or ~/.cache/hyperloom"
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming."""

    every: int = knob(0, "steps between checkpoints (0 = only at the end)")
    keep: int = knob(2, "how many of the newest checkpoints to keep")
    resume: str = knob(
        "auto", "auto = newest checkpoint in the run dir; none; or a checkpoint path"
    )
    async_save: bool = knob(
        False, "stage a CPU copy and write it in a background thread while training goes on"
    )
    format: str = knob(
        "whole",
        "whole = gathered tensors, one safetensors file by the main rank; sharded = every rank "
        "writes its own shards (torch.distributed.checkpoint), resharded on load",
        choices=["whole", "sharded"],
    )


@dataclass(frozen=True)
class LoggingConfig:
    """What a run reports and where."""

    run_dir: str = knob("runs/default", "directory for metrics, plots, checkpoints")
    log_every: int = knob(10, "steps between metric lines")
    peak_tflops: float = knob(
        0.0, "peak TFLOP/s for MFU; 0 = measure this machine's BF16 matmul peak"
    )
    progress: bool = knob(True, "show a progress bar")
    plot: bool = knob(True, "write loss_curve.png")
    sample_prompt: str = knob("def ", "prompt for the sample printed after training ('' = none)")
    sample_tokens: int = knob(96, "tokens to generate for that sample")
    self_check: str = knob(
        "auto",
        "planner's predicted step time and memory beside the measured ones: auto (a profile "
        "of this machine, measured once and cached), off, or a `plan calibrate` JSON",
    )


@dataclass(frozen=True)
class ResilienceConfig:
    """Anomaly detection, recovery, hang watchdog and fault drills (hyperloom.resilience)."""

    on_anomaly: str = knob(
        "skip",
        "on NaN/Inf or a spike: skip the update, rollback to the last stable checkpoint, "
        "stop, or none (no checks, no per-step sync)",
        choices=["skip", "rollback", "stop", "none"],
    )
    window: int = knob(128, "healthy steps in the running mean/sigma/max of loss and grad norm")
    sigma: float = knob(6.0, "a spike is above mean + sigma x std of the window")
    max_factor: float = knob(10.0, "... or above this factor x the window's maximum")
    warmup: int = knob(64, "healthy steps before spikes are checked (NaN/Inf always are)")
    stable_steps: int = knob(10, "healthy steps after a checkpoint that make it stable")
    lr_factor: float = knob(1.0, "multiply the learning rate by this after each rollback")
    max_rollbacks: int = knob(3, "give up after this many rollbacks within rollback_window")
    rollback_window: int = knob(1000, "steps over which rollbacks are counted")
    watchdog_s: float = knob(0.0, "exit (for torchrun to restart) after this long without a step")
    max_stalled_restarts: int = knob(3, "stop after this many restarts without progress")
    inject: str = knob(
        "",
        "fault drill: kind@step[,...] with kind nan_grad, loss_spike, crash, hang, "
        "kill_during_save, disk_full, writer_crash (also from HYPERLOOM_INJECT)",
    )


@dataclass(frozen=True)
class OpsConfig:
    """Fused operators (hyperloom.engine.ops): RMSNorm, SwiGLU, RoPE, cross-entropy, attention."""

    fused: bool = knob(True, "use the fused operators (false = plain reference PyTorch)")
    compile: bool = knob(
        True, "build the fused kernels with torch.compile (false = same algorithms, eager)"
    )
    reference: list[str] = knob(
        doc="ops kept on the reference path when fused: rmsnorm, swiglu, rope, "
        "cross_entropy, attention",
        factory=list,
    )
    ce_chunk_tokens: int = knob(
        0, "tokens per chunk of the fused cross-entropy (0 = logits chunk ~ hidden size)"
    )
    triton: bool = knob(
        False,
        "hand-written Triton kernels for RMSNorm and SwiGLU (GPU, or the interpreter with "
        "TRITON_INTERPRET=1; without either, a warning and the fused kernels); off: their "
        "speed against the torch.compile kernels is not measured yet",
    )


@dataclass(frozen=True)
class JobConfig:
    """A whole training job."""

    model: ModelConfig = knob(doc="model architecture", factory=ModelConfig)
    parallel: ParallelConfig = knob(doc="parallel layout", factory=ParallelConfig)
    precision: PrecisionConfig = knob(doc="numeric formats", factory=PrecisionConfig)
    train: TrainConfig = knob(doc="training loop", factory=TrainConfig)
    data: DataConfig = knob(doc="data", factory=DataConfig)
    checkpoint: CheckpointConfig = knob(doc="checkpoints", factory=CheckpointConfig)
    logging: LoggingConfig = knob(doc="reporting", factory=LoggingConfig)
    resilience: ResilienceConfig = knob(doc="self-healing training", factory=ResilienceConfig)
    ops: OpsConfig = knob(doc="fused operators", factory=OpsConfig)


# --------------------------------------------------------------------------- raw dicts


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section_types() -> dict[str, type]:
    return dict(_hints(JobConfig).items())


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts (TOML-serialisable)."""
    return dataclasses.asdict(cfg)


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _suggest(name: str, known: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, known, n=1)
    full = f"{prefix}.{close[0]}" if close and prefix else (close[0] if close else "")
    return f" (did you mean '{full}'?)" if close else ""


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`["--train.steps", "200", "--model.dim=256"]` -> `{"train": {"steps": "200"}, ...}`.

    Values stay strings here; they are converted with the field's type when the config is
    built, so the error for a bad value can name the field and its type.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(
                f"unexpected argument '{token}': overrides look like --section.key value"
            )
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and "." in args[i + 1]):
                raise ConfigError(f"override --{key} has no value")
            value = args[i + 1]
            i += 1
        i += 1
        parts = key.replace("-", "_").split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(
                f"override --{key}: expected --section.key (e.g. --train.steps 200); "
                f"sections are {', '.join(_section_types())}"
            )
        out.setdefault(parts[0], {})[parts[1]] = _CliValue(value)
    return out


class _CliValue(str):
    """A string that came from the command line (so '200' may become an int)."""


def _convert(value: Any, typ: Any, key: str) -> Any:
    """Check or convert one value against its annotated type; raise with the key named."""
    origin = typing.get_origin(typ)
    from_cli = isinstance(value, _CliValue)
    if origin in (list, tuple):
        (item,) = typing.get_args(typ)[:1]
        if from_cli:
            text = str(value).strip()
            if text.startswith("["):
                try:
                    value = tomllib.loads(f"v = {text}")["v"]
                except tomllib.TOMLDecodeError as exc:
                    raise ConfigError(f"{key}: cannot read {text!r} as a list ({exc})") from None
            else:
                value = [v for v in text.split(",") if v]
            value = [_CliValue(v) if isinstance(v, str) else v for v in value]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported config annotation for {key}: {typ}")  # programming error
    if typ is bool:
        if from_cli:
            low = value.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"{key}: expected true or false, got {str(value)!r}")
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ is int:
        if from_cli:
            try:
                return int(value.replace("_", ""))
            except ValueError:
                raise ConfigError(f"{key}: expected an integer, got {str(value)!r}") from None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if typ is float:
        if from_cli:
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {str(value)!r}") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config annotation for {key}: {typ}")


def build_section(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """Build one section dataclass from a raw dict, reporting every problem with its key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{prefix}] must be a table, got {raw!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}"
        if name not in fields:
            problems.append(
                f"unknown key '{key}'{_suggest(name, list(fields), prefix)}; "
                f"[{prefix}] accepts: {', '.join(fields)}"
            )
            continue
        try:
            converted = _convert(value, hints[name], key)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        choices = fields[name].metadata.get("choices")
        if choices and converted not in choices:
            problems.append(f"{key} = {converted!r} is not one of: {', '.join(map(repr, choices))}")
            continue
        kwargs[name] = converted
    if problems:
        raise ConfigError(problems)
    return cls(**kwargs)


# --------------------------------------------------------------------------- loading


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a TOML file, turning I/O and syntax errors into `ConfigError`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{p}' is not valid TOML: {exc}") from None


def config_from_dict(raw: dict[str, Any], world_size: int | None = None) -> JobConfig:
    """Build and validate a `JobConfig` from raw nested dicts (TOML or overrides).

    `world_size` defaults to torchrun's WORLD_SIZE (1 outside torchrun).
    """
    from hyperloom.models.registry import preset_values  # local: models import config

    sections = _section_types()
    problems: list[str] = []
    for name, value in raw.items():
        if name not in sections:
            problems.append(
                f"unknown section '[{name}]'{_suggest(name, list(sections))}; "
                f"sections are: {', '.join(sections)}"
            )
        elif not isinstance(value, dict):
            problems.append(f"'{name}' must be a table ([{name}]), got {value!r}")
    if problems:
        raise ConfigError(problems)

    model_raw = dict(raw.get("model", {}))
    preset = model_raw.get("preset")
    if preset is not None:
        try:
            base = preset_values(str(preset))
        except KeyError as exc:
            raise ConfigError(f"model.preset: {exc.args[0]}") from None
        # The preset's values are typed already; user keys are layered on top.
        model_raw = {**base, **model_raw}
    built: dict[str, Any] = {}
    for name, cls in sections.items():
        section_raw = model_raw if name == "model" else raw.get(name, {})
        try:
            built[name] = build_section(cls, section_raw, name)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    cfg = JobConfig(**built)
    validate(cfg, world_size)
    return cfg


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    world_size: int | None = None,
) -> JobConfig:
    """The job from an optional TOML file plus dotted overrides, validated (against
    `world_size`, default torchrun's WORLD_SIZE)."""
    raw = read_toml(path) if path else {}
    if overrides:
        raw = _deep_merge(raw, parse_overrides(overrides))
    return config_from_dict(raw, world_size)


# --------------------------------------------------------------------------- validation


def world_size_from_env() -> int:
    """World size as torchrun announces it (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def validate(cfg: JobConfig, world_size: int | None = None) -> None:
    """Cross-field checks. Raises `ConfigError` listing every problem, arithmetic shown."""
    p: list[str] = []
    m, t, d = cfg.model, cfg.train, cfg.data

    def positive(key: str, value: float) -> bool:
        if value <= 0:
            p.append(f"{key} must be positive, got {value}")
            return False
        return True

    ok = all(
        [
            positive("model.dim", m.dim),
            positive("model.n_heads", m.n_heads),
            positive("model.n_kv_heads", m.n_kv_heads),
        ]
    )
    positive("model.n_layers", m.n_layers)
    positive("model.ffn_dim", m.ffn_dim)
    positive("model.max_seq_len", m.max_seq_len)
    positive("model.norm_eps", m.norm_eps)
    positive("model.rope_theta", m.rope_theta)
    positive("model.init_std", m.init_std)
    if m.vocab_size < 2:
        p.append(f"model.vocab_size must be at least 2, got {m.vocab_size}")
    if not 0.0 <= m.dropout < 1.0:
        p.append(f"model.dropout must lie in [0, 1), got {m.dropout}")
    if ok:
        if m.dim % m.n_heads:
            p.append(
                f"model.dim ({m.dim}) is not divisible by model.n_heads ({m.n_heads}): "
                f"{m.dim} / {m.n_heads} = {m.dim / m.n_heads:.4g}"
            )
        elif (m.dim // m.n_heads) % 2:
            p.append(
                f"head dim model.dim / model.n_heads = {m.dim} / {m.n_heads} = "
                f"{m.dim // m.n_heads} is odd; RoPE rotates pairs, so it must be even"
            )
        if m.n_heads % m.n_kv_heads:
            p.append(
                f"model.n_heads ({m.n_heads}) is not divisible by model.n_kv_heads "
                f"({m.n_kv_heads}): {m.n_heads} / {m.n_kv_heads} = {m.n_heads / m.n_kv_heads:.4g}"
            )
    if m.rope_scaling < 1:
        p.append(f"model.rope_scaling must be >= 1 (1 = no scaling), got {m.rope_scaling}")
    elif m.rope_scaling > 1 and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        p.append(
            f"model.rope_high_freq_factor ({m.rope_high_freq_factor}) must exceed "
            f"model.rope_low_freq_factor ({m.rope_low_freq_factor})"
        )

    positive("train.steps", t.steps)
    positive("train.micro_batch_size", t.micro_batch_size)
    positive("train.grad_accum", t.grad_accum)
    positive("train.lr", t.lr)
    positive("train.eval_batches", t.eval_batches)
    if t.warmup_steps < 0:
        p.append(f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        p.append(f"train.min_lr_ratio must lie in [0, 1], got {t.min_lr_ratio}")
    if t.schedule == "wsd" and not 0.0 < t.decay_fraction <= 1.0:
        p.append(
            f"train.decay_fraction must lie in (0, 1] for the wsd schedule, got {t.decay_fraction}"
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
    ):
        if value < 0:
            p.append(f"{key} must be >= 0, got {value}")

    if positive("data.seq_len", d.seq_len) and d.seq_len > m.max_seq_len:
        p.append(
            f"data.seq_len ({d.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
            f"raise model.max_seq_len or shorten the sequences"
        )
    if not 0.0 < d.val_fraction < 1.0:
        p.append(f"data.val_fraction must lie strictly between 0 and 1, got {d.val_fraction}")
    if d.max_corpus_mb < 0:
        p.append(f"data.max_corpus_mb must be >= 0 (0 = whole corpus), got {d.max_corpus_mb}")
    if d.source in ("text", "jsonl") and not d.paths:
        p.append(f"data.source = '{d.source}' needs data.paths (files or directories)")
    if d.source == "stdlib" and d.paths:
        p.append("data.paths is only used with data.source = 'text' or 'jsonl'")

    c, lg = cfg.checkpoint, cfg.logging
    if c.every < 0:
        p.append(f"checkpoint.every must be >= 0 (0 = only at the end), got {c.every}")
    positive("checkpoint.keep", c.keep)
    p.extend(_resilience_problems(cfg))
    positive("logging.log_every", lg.log_every)
    if lg.peak_tflops < 0:
        p.append(f"logging.peak_tflops must be >= 0 (0 = measure), got {lg.peak_tflops}")
    if lg.sample_tokens < 0:
        p.append(f"logging.sample_tokens must be >= 0, got {lg.sample_tokens}")

    par = cfg.parallel
    dims = {"dp": par.dp, "tp": par.tp, "pp": par.pp, "cp": par.cp}
    bad = [k for k, v in {**dims, "ep": par.ep}.items() if v < 1]
    if bad:
        p.extend(f"parallel.{k} must be >= 1, got {getattr(par, k)}" for k in bad)
    else:
        p.extend(_tensor_parallel_problems(cfg))
        p.extend(_pipeline_problems(cfg))
        if par.cp > 1:
            p.append(
                f"parallel.cp = {par.cp}: context parallelism is not built yet; this release "
                f"runs tp, sp, pp, dp (zero 0, 1 or 3) and ep"
            )
        world = world_size_from_env() if world_size is None else world_size
        product = par.dp * par.tp * par.pp * par.cp
        if product != world:
            expr = " * ".join(f"{k}({v})" for k, v in dims.items())
            p.append(f"{expr} = {product} != world size {world}")
        if par.dp % par.ep:
            p.append(
                f"parallel.ep ({par.ep}) must divide dp ({par.dp}): experts fold over the "
                f"data-parallel ranks"
            )
    p.extend(_moe_problems(cfg))
    p.extend(_fp8_high_precision_problems(cfg.precision.fp8_high_precision))
    p.extend(_fp8_layer_problems(cfg))
    if cfg.precision.fp8 != "none" and par.tp > 1 and not bad:
        p.extend(_fp8_tensor_parallel_problems(cfg))
    if p:
        raise ConfigError(p)


FP8_GEMMS = ("fprop", "dgrad", "wgrad")  # engine.fp8.recipes.GEMMS (no engine import here)


def _fp8_high_precision_problems(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in FP8_GEMMS]
    if unknown:
        return [
            f"precision.fp8_high_precision: {unknown} are not GEMMs of a linear layer; "
            f"allowed: {', '.join(FP8_GEMMS)}"
        ]
    if set(names) == set(FP8_GEMMS):
        return [
            "precision.fp8_high_precision names all three GEMMs, which leaves nothing in "
            "FP8; set precision.fp8 = 'none' instead"
        ]
    return []


def _fp8_layer_problems(cfg: JobConfig) -> list[str]:
    p8, n = cfg.precision, cfg.model.n_layers
    first, last = p8.fp8_bf16_first_layers, p8.fp8_bf16_last_layers
    if first < 0 or last < 0:
        return [
            f"precision.fp8_bf16_first_layers ({first}) and fp8_bf16_last_layers ({last}) "
            f"count transformer blocks: 0 or more"
        ]
    if p8.fp8 != "none" and first + last >= n:
        return [
            f"precision.fp8_bf16_first_layers + fp8_bf16_last_layers = {first + last} keeps "
            f"all {n} blocks in high precision, which leaves nothing in FP8; set "
            f"precision.fp8 = 'none' instead"
        ]
    return []


def _fp8_tensor_parallel_problems(cfg: JobConfig) -> list[str]:
    """FP8 with tp > 1: per-tensor recipes reduce their amax over the group, rowwise its row
    amaxes where the contraction dimension is sharded; block recipes need every
    tensor-parallel shard to be whole scale blocks (hyperloom.parallel.tensor_parallel)."""
    m, fp8, tp = cfg.model, cfg.precision.fp8, cfg.parallel.tp
    block = {"blockwise": 128, "mxfp8": 32}.get(fp8)
    if block is None or m.n_heads <= 0:
        return []
    if m.family == "deepseek":  # MLA's heads and the SwiGLU widths that split over tp
        q_rows = m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        kv_rows = m.n_heads * (m.qk_nope_head_dim + m.v_head_dim)
        wq = "wq_b" if m.q_lora_rank else "wq"
        dense = m.ffn_dim if m.n_dense_layers or not m.n_routed_experts else 0
        shared = m.n_shared_experts * m.moe_ffn_dim if m.n_routed_experts else 0
        widths = {
            f"model.n_heads * (qk_nope_head_dim + qk_rope_head_dim) ({wq} rows)": q_rows,
            "model.n_heads * (qk_nope_head_dim + v_head_dim) (wkv_b rows)": kv_rows,
            "model.n_heads * v_head_dim (wo columns)": m.n_heads * m.v_head_dim,
            "model.ffn_dim (the dense layers' w1, w3 rows, w2 columns)": dense,
            "model.n_shared_experts * model.moe_ffn_dim (the shared experts' width)": shared,
        }
    elif m.dim % m.n_heads:
        return []  # reported elsewhere
    else:
        head_dim = m.dim // m.n_heads
        widths = {
            "model.dim (wq rows, wo columns)": m.dim,
            "model.n_kv_heads * head_dim (wk, wv rows)": m.n_kv_heads * head_dim,
            "model.ffn_dim (w1, w3 rows, w2 columns)": m.ffn_dim,
        }
    return [
        f"precision.fp8 = '{fp8}' with parallel.tp = {tp}: {name} = {width} splits into "
        f"shards of {width / tp:.4g} features, not a multiple of the {block}-element scale "
        f"block; each shard must be a multiple of {block} (the width a multiple of "
        f"{block * tp}) so scale blocks do not straddle ranks"
        for name, width in widths.items()
        if width > 0 and (width % tp or (width // tp) % block)
    ]


def _resilience_problems(cfg: JobConfig) -> list[str]:
    from hyperloom.resilience.inject import parse_inject

    r, p = cfg.resilience, []
    for key, least in (("window", 2), ("max_rollbacks", 1), ("rollback_window", 1)):
        if getattr(r, key) < least:
            p.append(f"resilience.{key} must be >= {least}, got {getattr(r, key)}")
    if r.sigma <= 0 or r.max_factor <= 1:
        p.append(f"need resilience.sigma > 0 and max_factor > 1, got {r.sigma}, {r.max_factor}")
    for key in ("warmup", "stable_steps", "watchdog_s", "max_stalled_restarts"):
        if getattr(r, key) < 0:
            p.append(f"resilience.{key} must be >= 0, got {getattr(r, key)}")
    if not 0 < r.lr_factor <= 1:
        p.append(f"resilience.lr_factor must lie in (0, 1], got {r.lr_factor}")
    if r.on_anomaly == "rollback" and cfg.checkpoint.every == 0:
        p.append(
            "resilience.on_anomaly = 'rollback' needs periodic checkpoints to roll back to; "
            "set checkpoint.every > 0 (or use 'skip' or 'stop')"
        )
    try:
        faults = parse_inject(r.inject)
    except ValueError as exc:
        p.append(f"resilience.inject: {exc}")
        faults = []
    if any(f.kind == "writer_crash" for f in faults) and not cfg.checkpoint.async_save:
        p.append(
            "resilience.inject: writer_crash crashes the background checkpoint writer; "
            "set checkpoint.async_save = true"
        )
    return p


def pipeline_microbatches(par: ParallelConfig) -> int:
    """Micro-batches per pipelined step (the 0 default means 2 x pp, which every schedule
    accepts); 1 without pipeline parallelism."""
    if par.pp == 1:
        return 1
    return par.microbatches or 2 * par.pp


def pipeline_chunks(par: ParallelConfig) -> int:
    """Model chunks the layers are split into: pp x stages per rank (DualPipe's two copies
    of each chunk count once)."""
    per_rank = {"zb-v": 2, "dualpipev": 2, "interleaved": par.vpp}.get(par.pp_schedule, 1)
    return par.pp * per_rank


def _pipeline_problems(cfg: JobConfig) -> list[str]:
    from hyperloom.pipeline.schedules import ScheduleError, build_schedule

    par, t = cfg.parallel, cfg.train
    out = []
    if par.pp == 1:
        if par.microbatches > 1 or par.pp_layers:
            out.append(
                "parallel.microbatches and parallel.pp_layers need parallel.pp > 1 "
                "(use train.grad_accum to accumulate without a pipeline)"
            )
        return out
    try:
        build_schedule(par.pp_schedule, par.pp, pipeline_microbatches(par), par.vpp)
    except ScheduleError as exc:
        out.append(f"parallel.pp_schedule = '{par.pp_schedule}': {exc}")
        return out
    chunks = pipeline_chunks(par)
    n_layers = cfg.model.n_layers
    if par.pp_layers:
        if len(par.pp_layers) != chunks or sum(par.pp_layers) != n_layers:
            out.append(
                f"parallel.pp_layers {par.pp_layers} must give {chunks} chunks "
                f"(pp({par.pp}) x stages per rank) that sum to model.n_layers ({n_layers}); "
                f"got {len(par.pp_layers)} chunks summing to {sum(par.pp_layers)}"
            )
        elif min(par.pp_layers) < 0:
            out.append(f"parallel.pp_layers must be >= 0 each, got {par.pp_layers}")
    elif n_layers < chunks:
        out.append(
            f"model.n_layers ({n_layers}) < {chunks} pipeline chunks: every chunk needs a "
            f"layer (or set parallel.pp_layers with explicit zeros)"
        )
    if par.zero == 3:
        out.append(
            "parallel.zero = 3 with parallel.pp > 1: FSDP under pipeline parallelism is not "
            "built yet; use zero 0 or 1"
        )
    if t.compile:
        out.append("train.compile with parallel.pp > 1 is not built yet; set train.compile false")
    return out


def _deepseek_tensor_parallel_problems(cfg: JobConfig) -> list[str]:
    """tp > 1 for the DeepSeek family (hyperloom.models.deepseek.plan): heads and the shared
    experts' width split; no sequence parallelism for it yet."""
    m, par, tp = cfg.model, cfg.parallel, cfg.parallel.tp
    out = []
    shared = m.n_shared_experts * m.moe_ffn_dim
    if m.n_routed_experts and shared % tp:
        out.append(
            f"model.n_shared_experts * model.moe_ffn_dim ({shared}) is not divisible by "
            f"parallel.tp ({tp}): the shared experts' SwiGLU width splits over tp"
        )
    if par.sp:
        out.append(
            "parallel.sp = true with model.family = 'deepseek' is not built yet: the MoE "
            "router, balance losses and MLA would see a slice of each sequence; use sp = false"
        )
    return out


def _expert_parallel_problems(cfg: JobConfig) -> list[str]:
    """ep > 1 for an MoE model: the experts split evenly; DDP (zero 0) reduces the rest."""
    m, par = cfg.model, cfg.parallel
    out = []
    if m.n_routed_experts % par.ep:
        out.append(
            f"model.n_routed_experts ({m.n_routed_experts}) must be divisible by parallel.ep "
            f"({par.ep}): each expert-parallel rank holds n_routed_experts / ep experts"
        )
    if par.zero != 0:
        out.append(
            f"parallel.ep = {par.ep} with parallel.zero = {par.zero} is not built yet: the "
            f"sharded optimizers would mix different ranks' experts; use zero 0 (DDP)"
        )
    return out


def _moe_problems(cfg: JobConfig) -> list[str]:
    """The MoE / MLA / MTP keys (hyperloom.models.deepseek), arithmetic shown."""
    m, par = cfg.model, cfg.parallel
    out: list[str] = []
    if m.family != "deepseek":
        used = [k for k in ("n_routed_experts", "kv_lora_rank", "mtp_depth") if getattr(m, k)]
        if used:
            out.append(f"model.{used[0]} needs model.family = 'deepseek' (got '{m.family}')")
        if par.ep > 1:
            out.append(
                f"parallel.ep = {par.ep} needs a Mixture-of-Experts model "
                f"(model.family = 'deepseek' with model.n_routed_experts > 0)"
            )
        return out
    if par.ep > 1:
        out.extend(_expert_parallel_problems(cfg))
    if par.tp > 1:
        out.extend(_deepseek_tensor_parallel_problems(cfg))
    if par.zero == 3 and par.dp > 1:
        out.append(
            "parallel.zero = 3 with model.family = 'deepseek': FSDP would shard the routing "
            "biases that balancing updates in place; not built yet, use zero 0 or 1"
        )
    if m.qk_norm:
        out.append(
            "model.qk_norm is built for model.family = 'llama'; MLA (family 'deepseek') "
            "already normalises its query and key latents (q_norm, kv_norm)"
        )
    for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        if getattr(m, key) <= 0:
            out.append(f"model.{key} must be positive for MLA, got {getattr(m, key)}")
    if m.qk_rope_head_dim <= 0 or m.qk_rope_head_dim % 2:
        out.append(
            f"model.qk_rope_head_dim must be positive and even (RoPE rotates pairs), "
            f"got {m.qk_rope_head_dim}"
        )
    if m.q_lora_rank < 0:
        out.append(
            f"model.q_lora_rank must be >= 0 (0 = plain query projection), got {m.q_lora_rank}"
        )
    if m.mtp_depth < 0 or m.mtp_loss_weight < 0:
        out.append(
            f"model.mtp_depth ({m.mtp_depth}) and model.mtp_loss_weight ({m.mtp_loss_weight}) must be >= 0"
        )
    if not 0 <= m.n_dense_layers <= m.n_layers:
        out.append(
            f"model.n_dense_layers ({m.n_dense_layers}) must lie in [0, model.n_layers ({m.n_layers})]"
        )
    for key in (
        "moe_bias_rate",
        "moe_seq_aux_alpha",
        "moe_aux_alpha",
        "moe_z_loss",
        "moe_capacity_factor",
    ):
        if getattr(m, key) < 0:
            out.append(f"model.{key} must be >= 0, got {getattr(m, key)}")
    E, k = m.n_routed_experts, m.moe_top_k
    if E < 0 or m.n_shared_experts < 0:
        out.append(
            f"model.n_routed_experts ({E}) and model.n_shared_experts ({m.n_shared_experts}) must be >= 0"
        )
    if E <= 0:
        if m.n_dense_layers < m.n_layers and E == 0 and m.n_layers > 0:
            out.append(
                f"model.n_routed_experts = 0 but layers {m.n_dense_layers}..{m.n_layers - 1} are MoE "
                f"(model.n_dense_layers = {m.n_dense_layers}); set experts or n_dense_layers = n_layers"
            )
        return out
    if not 1 <= k <= E:
        out.append(f"model.moe_top_k ({k}) must lie in [1, model.n_routed_experts ({E})]")
    if m.moe_ffn_dim <= 0:
        out.append(f"model.moe_ffn_dim must be positive, got {m.moe_ffn_dim}")
    G, kg = m.moe_n_groups, m.moe_topk_groups
    if G < 1 or E % G:
        out.append(
            f"model.n_routed_experts ({E}) is not divisible by model.moe_n_groups ({G}): "
            f"{E} / {G} = {E / G if G else float('nan'):.4g} experts per group"
        )
    elif not 1 <= kg <= G:
        out.append(f"model.moe_topk_groups ({kg}) must lie in [1, model.moe_n_groups ({G})]")
    elif kg * (E // G) < k:
        out.append(
            f"group-limited routing keeps moe_topk_groups({kg}) x {E} / {G} experts per group = "
            f"{kg * (E // G)} experts < model.moe_top_k ({k})"
        )
    elif G > 1 and m.moe_score == "sigmoid" and E // G < 2:
        out.append(
            f"sigmoid routing scores a group by its top-2 experts, but {E} / {G} = {E // G} "
            f"expert per group; use fewer groups"
        )
    return out


def _tensor_parallel_problems(cfg: JobConfig) -> list[str]:
    m, par, tp = cfg.model, cfg.parallel, cfg.parallel.tp
    out = []
    for key in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        value = getattr(m, key)
        if value > 0 and value % tp:
            out.append(
                f"model.{key} ({value}) is not divisible by parallel.tp ({tp}): each tensor-"
                f"parallel rank needs a whole share, {value} / {tp} = {value / tp:.4g}"
            )
    if par.sp and tp > 1 and cfg.data.seq_len % tp:
        out.append(
            f"data.seq_len ({cfg.data.seq_len}) is not divisible by parallel.tp ({tp}); "
            f"sequence parallelism splits the sequence into tp equal parts"
        )
    if m.dropout > 0 and tp > 1:
        out.append(
            f"model.dropout = {m.dropout} with parallel.tp = {tp} is not supported: the "
            f"tensor-parallel ranks hold different slices (heads, sequence) of one tensor but "
            f"share one RNG stream, so their masks would repeat slice to slice (Megatron keeps "
            f"an RNG tracker for this); use model.dropout = 0 or parallel.tp = 1"
        )
    names = [n.strip() for n in par.order.split(",") if n.strip()]
    if sorted(names) != sorted(["pp", "dp", "cp", "tp"]):
        out.append(f"parallel.order must name pp, dp, cp and tp once each, got {par.order!r}")
    return out


# --------------------------------------------------------------------------- printing


def dumps_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML, every key followed by its doc as a comment."""
    lines: list[str] = []
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        lines.append(f"[{section.name}]  # {type(value).__doc__.strip().splitlines()[0]}")
        for f in dataclasses.fields(value):
            rendered = tomli_w.dumps({f.name: getattr(value, f.name)}).strip()
            doc = f.metadata.get("doc", "")
            lines.append(f"{rendered:<40} # {doc}" if doc else rendered)
        lines.append("")
    return "\n".join(lines)


def dump_toml_file(cfg: JobConfig, path: str | os.PathLike) -> None:
    Path(path).write_text(dumps_toml(cfg))
