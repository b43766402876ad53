"""The single-process training loop.

One optimizer step is `grad_accum` micro-batches under autocast (BF16 compute, FP32 master
weights and Adam state), global-norm clipping, the scheduled LR and AdamW. Losses stay on the
device until a log step, so the loop does not stall an accelerator. Resuming restores weights,
optimizer, step, data position and every RNG stream, so a split run equals an uninterrupted
one bit for bit on CPU; `train.stop_at_step` makes such a split.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyperloom import checkpoint as ckpt
from hyperloom.accelerator import (
    DTYPES,
    configure_host_allocator,
    get_accelerator,
    measure_matmul_tflops,
)
from hyperloom.config import ConfigError, JobConfig, dumps_toml, is_auto, pipeline_microbatches
from hyperloom.data import DataBundle, ResumableLoader, build_data, val_batches
from hyperloom.data.blend import describe_mix
from hyperloom.data.multimodal import (
    MultimodalLoader,
    build_multimodal_data,
    multimodal_val_batches,
)
from hyperloom.data.sft_packing import SFTLoader, sft_val_batches
from hyperloom.engine.fp8 import end_fp8_step, fp8_state_dict, load_fp8_state_dict
from hyperloom.engine.ops.kernels import preload_triton
from hyperloom.models.freeze import freeze_problems
from hyperloom.models.registry import build_model, family
from hyperloom.parallel import build_mesh, build_parallel_model, init_distributed, overlap
from hyperloom.parallel.context_parallel import context_shard
from hyperloom.parallel.overlap_accum import OverlappedAccumulation
from hyperloom.pipeline.runtime import build_pipeline
from hyperloom.resilience.guard import Guard
from hyperloom.train.optim import build_optimizer, lr_at
from hyperloom.train.planning import add_self_check, choose_recompute
from hyperloom.train.profile import StepProfiler
from hyperloom.train.report import (
    bits_per_byte,
    run_dir_writes,
    text_bytes_per_token,
    write_summary,
)
from hyperloom.train.sinks import TrackedReporter, check_sinks

log = logging.getLogger("hyperloom.train")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in FP32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())  # (b*s, vocab)


@dataclass
class RunResult:
    summary: dict[str, Any]
    run_dir: Path


class Trainer:
    """One training run; implements resilience's `GuardedRun` for its `Guard`."""

    def __init__(self, cfg: JobConfig, data: DataBundle | None = None):
        cfg = ckpt.prepare_init_from(cfg)  # a Hugging Face init_from: checked, its tokenizer
        check_sinks(cfg.logging)  # a sink's package missing: one line, before anything is built
        self.cfg = cfg
        t = cfg.train
        self.run_dir = Path(cfg.logging.run_dir)
        self.acc = get_accelerator(t.device, index=int(os.environ.get("LOCAL_RANK", "0")))
        # CPU: before any large tensor, so the heap serves them all; None on other devices
        self.host_allocator = (
            configure_host_allocator(t.host_allocator) if self.acc.kind == "cpu" else None
        )
        if t.freeze:  # checked on the whole model before any process group exists
            problems = freeze_problems(build_model(cfg.model), t.freeze)
            if problems:
                raise ConfigError(problems)
        init_distributed(self.acc)
        self.mesh = build_mesh(cfg.parallel, self.acc)
        self.dtype = DTYPES[cfg.precision.dtype]
        torch.manual_seed(t.seed)
        self.data = data or self._build_data()
        # What this rank holds before the model: the planner's self-check predicts the rest.
        if (cfg.ops.fused and cfg.ops.compile) or t.compile:
            preload_triton()  # torch.compile would import it inside the first step
        self.memory_baseline = self.acc.current_memory_bytes()
        # recompute auto: the planner picks this stage's policy; `run_cfg` is what runs
        self.recompute_choice = choose_recompute(self) if is_auto(t.recompute) else None
        self.run_cfg = cfg
        if self.recompute_choice is not None:
            policy = self.recompute_choice.policies[self.mesh.rank("pp")]
            self.run_cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, recompute=policy))
        if cfg.parallel.pp > 1:  # stages of the model on this rank, run by a schedule
            self.pm = build_pipeline(
                self.run_cfg, self.mesh, self.acc.device, lambda: self.acc.autocast(self.dtype)
            )
        else:
            self.pm = build_parallel_model(self.run_cfg, self.mesh, self.acc.device)
        self.model = self.pm.inner
        self.fwd = self.pm.forward_module
        self.optimizer = build_optimizer(self.pm, t)
        # parallel.ep_overlap without a pipeline: micro-batch i's forward beside i-1's backward
        overlapped = cfg.parallel.ep_overlap and not self.pm.pipelined
        self.overlapped = OverlappedAccumulation(self.pm) if overlapped else None
        # Every data-parallel rank draws the same global batch and keeps its own rows, so a
        # layout sees exactly the sequences a single process with dp x the batch would.
        self.dp, self.dp_rank = self.mesh.size("dp"), self.mesh.rank("dp")
        # Under pp each step feeds `microbatches` micro-batches of micro_batch_size rows.
        self.rows = t.micro_batch_size * pipeline_microbatches(cfg.parallel)
        make_loader, make_val = (  # a vlm's batches hold ImageTokens (models.vlm)
            (MultimodalLoader, multimodal_val_batches)
            if cfg.model.family == "vlm"
            else (SFTLoader, sft_val_batches)  # packed conversations, answer-only labels
            if cfg.data.source == "sft"
            else (ResumableLoader, val_batches)
        )
        self.loader = make_loader(
            self.data.train, self.rows * self.dp, cfg.data.seq_len, seed=t.seed
        )
        # Context parallelism: each cp rank keeps its chunks of every sequence (inputs and
        # labels alike), and losses are averaged over the cp ranks as well as dp.
        self.context = context_shard(self.mesh, cfg.parallel.cp_comm)
        val = make_val(self.data.val, self.rows, cfg.data.seq_len, t.eval_batches)
        self.val = [self._context_part(x, y) for x, y in val]
        # bits per byte beside the loss: the held-out batches' text bytes per token
        self.val_bytes_per_token = (
            None
            if cfg.model.family == "vlm"
            else text_bytes_per_token(self.data.tokenizer, (y for _, y in val))
        )
        fam = family(cfg.model.family)
        self.n_params = fam.param_count(cfg.model)
        self.flops_per_token = fam.training_flops_per_token(cfg.model, cfg.data.seq_len)
        self.tokens_per_step = self.rows * self.dp * t.grad_accum * cfg.data.seq_len
        self.step = 0
        self.tokens_seen = 0
        self.resumed_from: Path | None = None
        self._measured: tuple[float, float] | None = None  # run(): step s, peak bytes
        self.guard = Guard(self)  # anomaly checks, recovery, checkpoint writer, watchdog

    def _build_data(self) -> DataBundle:
        # The main rank fills the cache first; the others then read it instead of racing.
        if self.mesh.world_size > 1 and not self.mesh.is_main:
            dist.barrier()
        m = self.cfg.model
        if m.family == "vlm":  # image-text samples with image placeholders
            from hyperloom.config.models.vlm import tokens_per_image

            mm = build_multimodal_data(
                self.cfg.data,
                vocab_size=m.vocab_size,
                image_size=m.image_size,
                image_token_id=m.image_token_id,
                tokens_per_image=tokens_per_image(m),
            )
            bundle = DataBundle(mm.tokenizer, mm.train, mm.val, mm.info)
        else:
            progress = self.cfg.logging.progress and self.mesh.is_main
            bundle = build_data(self.cfg.data, m.vocab_size, progress=progress)
        if self.mesh.world_size > 1 and self.mesh.is_main:
            dist.barrier()
        return bundle

    def barrier(self) -> None:
        if self.mesh.world_size > 1:
            dist.barrier()

    # ------------------------------------------------------------------ GuardedRun

    def local_parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.pm.local_params()]

    def data_position(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def set_data_position(self, position: dict[str, Any]) -> None:
        self.loader.load_state_dict(position)

    def synchronize(self) -> None:
        self.acc.synchronize()

    # ------------------------------------------------------------------ state

    def save(self, last_loss: float | None, wait: bool = False) -> Path | None:
        """Checkpoint (a collective), maybe in the background: `wait` returns only once it is
        committed. Whole tensors the main rank writes, or every rank's shards (sharded).

        Parameters or optimizer state holding NaN or Inf are never saved: None (an event), or,
        for a save that is waited for (the final one), TrainingHalted. A save that could not
        be written, even by the writer's retry, raises CheckpointError on every rank."""
        fmt = self.cfg.checkpoint.format
        sharded = fmt == "sharded"
        nonfinite = ckpt.nonfinite_state(self.pm, self.optimizer)
        if not self.guard.may_save(self.step, nonfinite, final=wait):
            return None
        # sharded: model and optimizer tensors both in DCP's state, none in train_state.pt
        model_state, optimizer = ckpt.state_to_save(self.pm, self.optimizer, fmt)
        train_state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "optimizer": optimizer,
            "loader": self.loader.state_dict(),
            "rng": self._per_rank(ckpt.rng_state(self.acc.rng_state())),
            "layout": self.mesh.describe(),
            "fp8": self._fp8_state(),  # delayed-scaling amax histories and scales
            "resilience": self.guard.state_dict(),  # LR scale after rollbacks, spike stats
        }
        path = ckpt.checkpoint_dir(self.run_dir, self.step)
        files = {}
        if self.mesh.is_main:
            # The tokenizer's bytes, not a scratch file in the run dir that a second job there
            # (orphaned workers) could race on.
            files = {
                "config.toml": dumps_toml(self.cfg),
                "tokenizer.json": self.data.tokenizer.to_json(),
            }
        error = None
        if self.mesh.is_main or sharded:
            try:
                path = self.guard.save(
                    self.step,
                    model_state,
                    train_state,
                    files,
                    {"tokens_seen": self.tokens_seen, "loss": last_loss},
                    wait=wait,
                )
            except ckpt.CheckpointError as exc:  # a save, this one or an earlier, is lost
                error = str(exc)
        self._stop_on_save_error(error)  # also the barrier after a save
        return path

    def _stop_on_save_error(self, error: str | None) -> None:
        """Raise CheckpointError on every rank if the main rank's saves failed (a collective:
        in the whole format only the main rank writes, so only it knows)."""
        if self.mesh.world_size > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise ckpt.CheckpointError(error)

    def _fp8_state(self) -> dict[str, torch.Tensor]:
        """FP8 scaling state by global module name (under pp a collective over its ranks)."""
        if self.cfg.precision.fp8 == "none":
            return {}
        return self.pm.fp8_state_dict() if self.pm.pipelined else fp8_state_dict(self.model)

    def _measured_peak(self) -> float:
        """The MFU denominator: the BF16 matmul peak, as is usual, or the training dtype's
        where that is faster. A CPU without BF16 units multiplies BF16 a hundred times slower
        than FP32, and an FP32 run measured against that would report an MFU above one."""
        kind, dtype = self.acc.kind, self.cfg.precision.dtype
        bf16 = measure_matmul_tflops(kind, "bf16")
        return bf16 if dtype == "bf16" else max(bf16, measure_matmul_tflops(kind, dtype))

    def maybe_resume(self) -> None:
        choice = self.cfg.checkpoint.resume
        if choice == "none":
            return
        if choice == "auto":  # newest committed and verified; each one passed over is told
            path = self.guard.latest_checkpoint()
        else:
            path = ckpt.resolve_checkpoint(choice)
            ckpt.verify_checkpoint(path)
        if path is None:
            return
        self.load_checkpoint(path)

    def maybe_init_from(self) -> dict[str, Any] | None:
        """`checkpoint.init_from` for a run that resumed nothing: weights only, step 0 (a
        training stage starting from the last one's result, or a decoder from a text run)."""
        source = self.cfg.checkpoint.init_from
        if not source or self.resumed_from is not None:
            return None
        report = ckpt.load_initial_weights(self.pm, source, self.cfg.model)
        log.info(
            "initialised %d tensors from %s; %d kept their init (%s)",
            report["loaded"],
            report["checkpoint"],
            report["kept_fresh"],
            ", ".join(report["fresh_parts"]) or "none",
        )
        return report

    def load_checkpoint(self, path: Path) -> None:
        """Restore everything a verified checkpoint holds (also a resilience rollback)."""
        state = ckpt.load_train_state(path)
        try:
            ckpt.load_state(self.pm, self.optimizer, path, state)  # any layout wrote it
            if self.pm.pipelined:  # each rank loads its chunks' share, by global name
                self.pm.load_fp8_state_dict(state.get("fp8", {}))
            else:
                load_fp8_state_dict(self.model, state.get("fp8", {}))
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ckpt.CheckpointError(
                f"checkpoint {path} does not fit this job's model/optimizer "
                f"(was it written with another [model] section?): {exc}"
            ) from None
        self.loader.load_state_dict(state["loader"])
        rngs = state["rng"]
        # Same world size: every rank gets its own streams back; otherwise rank 0's.
        mine = rngs[self.mesh.global_rank] if len(rngs) == self.mesh.world_size else rngs[0]
        self.acc.set_rng_state(ckpt.restore_rng(mine))
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.guard.load_state_dict(state.get("resilience", {}))
        self.resumed_from = path
        log.info(
            "resumed from %s at step %d (saved with %s)",
            path,
            self.step,
            state.get("layout", "1 process"),
        )

    # ------------------------------------------------------------------ steps

    def _local_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = self.loader.next_batch()  # (rows * dp, seq) each
        rows = slice(self.dp_rank * self.rows, (self.dp_rank + 1) * self.rows)
        inputs, labels = self._context_part(inputs[rows], labels[rows])
        return inputs.to(self.acc.device), labels.to(self.acc.device)

    def _context_part(self, inputs: torch.Tensor, labels: torch.Tensor):
        """This context-parallel rank's part of each sequence (the whole without cp)."""
        if self.context is None:
            return inputs, labels
        return self.context.shard(inputs), self.context.shard(labels)

    def _micro_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's forward under autocast: its loss over train.grad_accum. The
        model computes its own loss from the final hidden states, so a fused head never
        materialises the logits (vocab-parallel under tp)."""
        with self.acc.autocast(self.dtype):
            return self.fwd(inputs, labels=labels) / self.cfg.train.grad_accum

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (mean loss on this rank, grad norm) as device tensors."""
        t = self.cfg.train
        self.pm.module.train()
        total = torch.zeros((), device=self.acc.device)
        if self.overlapped is not None:  # F_i beside B_{i-1}, reduced as DDP would
            total += self.overlapped.run(t.grad_accum, self._local_batch, self._micro_loss)
        for i in range(0 if self.overlapped is not None else t.grad_accum):
            inputs, labels = self._local_batch()
            if self.pm.pipelined:  # forward and backward as the schedule says
                total += self.pm.run_step(inputs, labels, scale=1.0 / t.grad_accum)
                continue
            with self.pm.sync_context(last_micro_batch=i == t.grad_accum - 1):
                loss = self._micro_loss(inputs, labels)
                loss.backward()
            # Delayed FP8 scaling: the dp replicas' amaxes of this micro-batch, reduced.
            self.pm.sync_fp8_replicas(recent=1)
            total += loss.detach()
        self.guard.inject_grads(self.step + 1, total)  # fault drills only
        grad_norm = self.pm.reduce_and_clip(self.optimizer, t.grad_clip)
        end_fp8_step(self.model)  # delayed FP8 'step': scales move once, after all reductions
        lr = lr_at(self.step, t) * self.guard.lr_scale  # lowered by rollbacks
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.guard.healthy(self.step + 1, total, grad_norm):  # else the update is dropped
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        balance = getattr(self.model, "after_optimizer_step", None)
        if balance is not None:  # MoE: expert loads summed over dp move the routing biases
            balance(self.mesh.group("dcp"))
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return total, grad_norm

    def _per_rank(self, value: Any) -> list[Any]:
        """`value` from every rank, in rank order (a collective)."""
        if self.mesh.world_size == 1:
            return [value]
        everyone: list[Any] = [None] * self.mesh.world_size
        dist.all_gather_object(everyone, value)
        return everyone

    def dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean over the data- and context-parallel ranks (their losses are over different
        tokens; a cp rank's is weighted so that the mean is the sequence's)."""
        group = self.mesh.group("dcp")
        if group is not None:
            value = value.clone()
            dist.all_reduce(value, group=group)
            value /= self.mesh.size("dcp")
        return value

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        if self.pm.pipelined:
            mean = torch.tensor(self.pm.evaluate(self.val), device=self.acc.device)
        else:
            losses = []
            for inputs, labels in self.val:
                with self.acc.autocast(self.dtype):
                    loss = self.fwd(inputs.to(self.acc.device), labels=labels.to(self.acc.device))
                losses.append(loss)
            self.pm.reshard()
            mean = torch.stack(losses).mean()
        if self.context is not None:  # each cp rank saw its part of every sequence
            mean = self.context.mean(mean)
        return mean.item()  # every dp rank saw the same batches

    # ------------------------------------------------------------------ loop

    def _bits_per_byte(self, initial: float | None, final: float | None) -> dict[str, float]:
        """The summary's validation losses in bits per byte (text families)."""
        bpt = self.val_bytes_per_token
        if not bpt:
            return {}
        named = {"initial_val_bpb": initial, "final_val_bpb": final}
        return {k: bits_per_byte(v, bpt) for k, v in named.items() if v is not None}

    def _mfu(self, tokens_per_s: float, peak_tflops: float) -> float:
        return tokens_per_s * self.flops_per_token / (peak_tflops * 1e12)

    def run(self, defer_self_check: bool = False) -> RunResult:
        """Train to `train.steps` (or resume there) and return the summary; with
        `defer_self_check` the planner's self-check is left to `add_self_check`."""
        cfg, t, lg = self.cfg, self.cfg.train, self.cfg.logging
        self.maybe_resume()
        initialised = self.maybe_init_from()
        end_step = min(t.steps, t.stop_at_step) if t.stop_at_step else t.steps
        if self.step >= end_step:
            log.warning(
                "the checkpoint in %s is at step %d, which already reaches the planned %d steps; "
                "nothing to train (raise train.steps or use a new --run-dir)",
                self.run_dir,
                self.step,
                end_step,
            )
        main = self.mesh.is_main
        # Only the main rank reports MFU, so only it spends time measuring the peak.
        peak = lg.peak_tflops or (self._measured_peak() if main else 1.0)
        if main:
            with run_dir_writes(self.run_dir / "config.toml"):
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / "config.toml").write_text(dumps_toml(cfg))
            # summary.json is the record of a finished run: an earlier run's would name
            # checkpoints this one may prune, and stay if this one fails
            with run_dir_writes(self.run_dir / "summary.json"):
                (self.run_dir / "summary.json").unlink(missing_ok=True)
        reporter = TrackedReporter(  # metrics.jsonl, and logging.sinks' TensorBoard / W&B
            cfg,
            self.step,
            t.steps,
            progress=lg.progress,
            append=self.resumed_from is not None,
            enabled=main,
        )
        log.info(
            "model %s (%s parameters, %.3g GFLOP/token) on %s, %s, layout %s; %s tokens/step",
            cfg.model.preset,
            f"{self.n_params:,}",
            self.flops_per_token / 1e9,
            self.acc.describe(),
            cfg.precision.dtype,
            self.mesh.describe(),
            f"{self.tokens_per_step:,}",
        )
        first_step = self.step
        initial_val = self.evaluate() if first_step == 0 else None
        if initial_val is not None:
            reporter.eval_metrics(0, initial_val, self.val_bytes_per_token)
        self.acc.reset_peak_memory()
        wall_start = time.perf_counter()
        window = _Window(self.dp_mean)
        last_loss = val_loss = None
        train_time = 0.0
        reporter.start(first_step)
        self.guard.attach(reporter.event)
        blend = getattr(self.loader, "blend", None)  # a weighted blend: the planned mix
        if blend is not None and main:
            mix = blend.plan(t.steps * self.tokens_per_step // cfg.data.seq_len)
            log.info("%s", describe_mix(mix, f"planned for {t.steps} steps"))
            reporter.event({"event": "data_mix", "step": self.step, "planned": mix})
        a2a = [0.0, 0.0, 0]  # expert all-to-all: exposed s, in flight s, steps since logged
        profiler = StepProfiler(lg, self.run_dir, self.acc.kind, self.mesh.global_rank, self.step)
        try:
            self.guard.start(self.step)  # restart-loop guard, watchdog
            while self.step < end_step:
                overlap.STATS.reset()
                with profiler.step(self.step + 1):  # logging.profile's steps: torch.profiler
                    loss, grad_norm = self.train_step()
                a2a = [
                    a2a[0] + overlap.STATS.exposed_s,
                    a2a[1] + overlap.STATS.in_flight_s,
                    a2a[2] + 1,
                ]
                window.add(loss, self.tokens_per_step)
                reporter.step(self.step)
                if self.step % lg.log_every == 0 or self.step == end_step:
                    self.acc.synchronize()
                    elapsed, last_loss, tps = window.take()
                    train_time += elapsed
                    record = {
                        "step": self.step,
                        "loss": last_loss,
                        "lr": lr_at(self.step - 1, t),
                        "grad_norm": grad_norm.item(),
                        "tokens_per_s": tps,
                        "mfu": self._mfu(tps, peak),
                        "memory_gb": self.acc.peak_memory_bytes() / 1e9,
                        "elapsed_s": time.perf_counter() - wall_start,
                    }
                    load = getattr(self.model, "expert_load", None)
                    if load:  # MoE: max/mean tokens per expert of the last step, per layer
                        record["expert_load"] = load
                        record["expert_load_max"] = max(load.values())
                    if cfg.parallel.ep > 1 and cfg.parallel.ep_dispatcher == "alltoall":
                        # this rank's dispatch/combine all-to-all per step: waited for
                        # (exposed) and start to end (parallel.ep_overlap hides the gap)
                        record["a2a_exposed_s"] = a2a[0] / a2a[2]
                        record["a2a_in_flight_s"] = a2a[1] / a2a[2]
                    a2a = [0.0, 0.0, 0]
                    reporter.train_metrics(record, t.steps, peak)
                self.guard.after_step()  # rollback or stop, drills, watchdog heartbeat
                if t.eval_every and self.step % t.eval_every == 0 and self.step < end_step:
                    val_loss = self.evaluate()
                    reporter.eval_metrics(self.step, val_loss, self.val_bytes_per_token)
                    window.restart()  # validation is not training time
                every = cfg.checkpoint.every
                if every and self.step % every == 0 and self.step < end_step:
                    self.save(last_loss)
                    window.restart()
            val_loss = self.evaluate()
            reporter.eval_metrics(self.step, val_loss, self.val_bytes_per_token)
            self.guard.check_final(self.step, val_loss)  # a run never ends "done" with NaN
        finally:
            profiler.close()  # a window the loop left early: what it recorded
            self.guard.close()  # waits for an in-flight save
            reporter.close()
        self._stop_on_save_error(self.guard.save_error)  # that save was lost: no final one
        train_peak = self.acc.peak_memory_bytes()  # before the final save gathers the state
        # A summary names only a committed checkpoint: the final save raises if it is not.
        ckpt_path = self.save(last_loss, wait=True) if self.step > first_step else self.resumed_from
        trained_tokens = (self.step - first_step) * self.tokens_per_step
        tps = trained_tokens / train_time if train_time > 0 else None
        summary = {
            "model": cfg.model.preset,
            "parameters": self.n_params,
            "device": self.acc.describe(),
            "dtype": cfg.precision.dtype,
            "steps": self.step,
            "steps_this_run": self.step - first_step,
            "tokens_seen": self.tokens_seen,
            "initial_val_loss": initial_val,
            "final_train_loss": last_loss,
            "final_val_loss": val_loss,
            **self._bits_per_byte(initial_val, val_loss),
            "tokens_per_s": tps,
            "mfu": self._mfu(tps, peak) if tps else None,
            "peak_tflops": peak,
            # the training steps' high-water mark, before the final save gathers the state
            "peak_memory_gb": train_peak / 1e9,
            "peak_memory_measures": self.acc.peak_memory_measures(),
            "wall_time_s": time.perf_counter() - wall_start,
            "checkpoint": str(ckpt_path) if ckpt_path else None,
        }
        summary["layout"] = self.mesh.describe()
        if blend is not None:  # the mix drawn from each source, this run and before
            summary["data_mix"] = blend.realised()
        if initialised is not None:
            summary["initialised_from"] = initialised
        if self.host_allocator is not None:
            summary["host_allocator"] = self.host_allocator
        summary["peak_memory_gb_per_rank"] = self._per_rank(summary["peak_memory_gb"])
        measured = self._per_rank(train_peak - self.memory_baseline)
        above_baseline = max(measured)
        if self.recompute_choice is not None:  # the choice beside what each rank measured
            choice, whole = self.recompute_choice, self._per_rank(train_peak)
            summary["recompute_auto"] = choice.summary() | {
                "measured_peak_gb_by_rank": [round(b / 1e9, 4) for b in whole],
                "measured_above_baseline_gb_by_rank": [round(b / 1e9, 4) for b in measured],
            }
            if main:
                log.info(
                    "recompute auto: %s; predicted peak %s GB by stage, measured %s GB by rank",
                    ", ".join(choice.policies),
                    ", ".join(f"{(b + choice.held_bytes) / 1e9:.3f}" for b in choice.peaks),
                    ", ".join(f"{b / 1e9:.3f}" for b in whole),
                )
        steps_run = self.step - first_step
        self._measured = (train_time / steps_run, above_baseline) if steps_run else None
        if main:
            if lg.plot:
                reporter.plot()
            if not defer_self_check:
                self.add_self_check(summary)
            write_summary(self.run_dir, summary)
        return RunResult(summary, self.run_dir)

    def add_self_check(self, summary: dict[str, Any]) -> None:
        """The planner's self-check into `summary` (`planning.add_self_check`)."""
        add_self_check(self, summary, self._measured)


class _Window:
    """Losses (device tensors) and tokens since the last log line, and the time they took."""

    def __init__(self, reduce) -> None:
        self.reduce = reduce  # averages a loss over the data-parallel ranks
        self.restart()
        self.losses: list[torch.Tensor] = []
        self.tokens = 0

    def restart(self) -> None:
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, tokens: int) -> None:
        self.losses.append(loss)
        self.tokens += tokens

    def take(self) -> tuple[float, float, float]:
        """(seconds, mean loss, tokens/s) of the window; starts a new one."""
        elapsed = time.perf_counter() - self.start
        mean_loss = self.reduce(torch.stack(self.losses).mean()).item()  # one sync per log
        tps = self.tokens / elapsed
        self.losses, self.tokens = [], 0
        self.restart()
        return elapsed, mean_loss, tps
