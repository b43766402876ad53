"""A pipelined model as the trainer sees it: this rank's chunks, the executor, and the
gradient bookkeeping that pipelining adds to tensor and data parallelism.

`build_pipeline` cuts the family's model into the schedule's chunks on the meta device
(parameter names stay global) and runs the parallelize recipe on each, so every chunk starts
from the single-device weights. Parameters held twice (a tied embedding on the first and last
chunk, DualPipe's two copies) get their gradients summed after the schedule, in memory or by
an all-reduce over the holders (Megatron's "embedding group"), so the copies stay equal; the
gradient norm counts each once.

FP8: checkpoints hold the scaling state by global name, gathered over pp. DualPipe's two
copies of a chunk, and dp replicas, reduce their delayed-scaling state after each step
(`sync_fp8_copies`, `sync_fp8_replicas`), as TransformerEngine reduces amaxes over replicas.
With `precision.fp8_delayed_update = "microbatch"` each copy's scales move with its own
micro-batches within a step, so delayed scaling there is close to, not equal to, one
process; with "step" every copy quantizes the whole step with the scale of the step's start
and the trainer's `end_fp8_step` moves it once after these reductions: one process's scales
(docs/fp8.md). Data parallelism under pp is reduced here after the schedule
(all-reduce or ZeRO-1) rather than by DDP, since a split backward accumulates weight
gradients outside autograd's hooks. FSDP with pp is not built.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hyperloom.config import JobConfig, pipeline_microbatches
from hyperloom.engine.fp8.convert import (
    fp8_buffers,
    fp8_state_dict,
    fp8_state_keys,
    load_fp8_state_dict,
)
from hyperloom.models.registry import build_model, family
from hyperloom.parallel.expert_parallel import ExpertParallelism
from hyperloom.parallel.layout import ParallelModel
from hyperloom.parallel.mesh import ParallelMesh, all_reduce_coalesced, all_reduce_scaling_state
from hyperloom.parallel.parallelize import materialize, parallelize, select_ops
from hyperloom.parallel.zero1 import ZeroOneAdamW
from hyperloom.pipeline.comm import add_communication
from hyperloom.pipeline.executor import PipelineExecutor
from hyperloom.pipeline.schedules import build_schedule, forward_only, pair_forward_backward


def layer_ranges(n_layers: int, n_chunks: int, counts: Sequence[int] = ()) -> list[range]:
    """Layers of each chunk: `counts` if given, else an even split whose remainder goes to
    the first chunks (the last one also carries the head, the heaviest single matmul)."""
    if counts:
        if len(counts) != n_chunks or sum(counts) != n_layers or min(counts) < 0:
            raise ValueError(
                f"layer counts {list(counts)} must be {n_chunks} numbers >= 0 summing to {n_layers}"
            )
    else:
        base, extra = divmod(n_layers, n_chunks)
        counts = [base + (c < extra) for c in range(n_chunks)]
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


class PipelineChunks(nn.Module):
    """This rank's model chunks, keyed by chunk index (names `chunks.C.<global name>`)."""

    def __init__(self, chunks: dict[int, nn.Module], pp_group=None):
        super().__init__()
        self.chunks = nn.ModuleDict({str(c): m for c, m in sorted(chunks.items())})
        self.pp_group = pp_group
        self.expert_load: dict[str, float] = {}  # MoE: the whole model's, every pp rank's

    def use_ops(self, impls) -> PipelineChunks:
        """Select the operator implementations of every chunk (see `Llama.use_ops`)."""
        for chunk in self.chunks.values():
            chunk.use_ops(impls)
        return self

    def init_weights(self, seed: int) -> None:
        """Every chunk from the single-device init stream (names are global)."""
        for chunk in self.chunks.values():
            chunk.init_weights(seed)

    def after_optimizer_step(self, group=None) -> dict[str, float]:
        """Each chunk's balancing step (MoE models; see `DeepSeekV3.after_optimizer_step`),
        then the per-layer expert loads of every pipeline rank merged (a collective over pp).

        Under DualPipe a layer has a copy on two pipeline ranks, each of which routed half of
        the micro-batches: the copies' expert counts are summed first, so both move their
        routing bias by the step's whole load, as the one-device model does."""
        if self.pp_group is not None:
            moe = {
                name: m
                for chunk in self.chunks.values()
                for name, m in getattr(chunk, "moe_layers", dict)().items()
                if m.counts is not None
            }
            parts: list[dict | None] = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(
                parts, {n: m.counts for n, m in moe.items()}, group=self.pp_group
            )
            for name, m in moe.items():
                m.counts = sum(part[name] for part in parts if part and name in part)
        loads: dict[str, float] = {}
        for chunk in self.chunks.values():
            step = getattr(chunk, "after_optimizer_step", None)
            if step is not None:
                loads.update(step(group))
        if self.pp_group is not None:
            dist.all_gather_object(parts, loads, group=self.pp_group)
            loads = {k: v for part in parts for k, v in (part or {}).items()}
        self.expert_load = loads
        return loads

    def global_names(self) -> list[tuple[str, nn.Parameter, int]]:
        """(name in the whole model, parameter, chunk) for every parameter copy here."""
        return [
            (name, p, int(c)) for c, m in self.chunks.items() for name, p in m.named_parameters()
        ]


@dataclass
class PipelineModel(ParallelModel):
    """`ParallelModel` whose forward and backward are a pipeline schedule."""

    executor: PipelineExecutor | None = None
    micro_batches: int = 1
    # name -> copies on this rank; name -> pp ranks holding it (when more than one)
    copies: dict[str, list[nn.Parameter]] = field(default_factory=dict)
    shared_groups: list[tuple[tuple[int, ...], list[str]]] = field(default_factory=list)
    # delayed-scaling buffer names -> pp ranks holding a copy (when more than one)
    fp8_shared: list[tuple[tuple[int, ...], list[str]]] = field(default_factory=list)
    owned: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    _eval_executors: dict[int, PipelineExecutor] = field(default_factory=dict)

    @property
    def pipelined(self) -> bool:
        return True

    # ------------------------------------------------------------------ steps

    def run_step(
        self, inputs: torch.Tensor, labels: torch.Tensor, scale: float = 1.0
    ) -> torch.Tensor:
        """Forward and backward of (mbs x micro-batches, seq) rows through the schedule;
        returns the step's loss (the mean over micro-batches, times `scale`) on every rank."""
        assert self.executor is not None
        xs, ys = inputs.chunk(self.micro_batches), labels.chunk(self.micro_batches)
        loss = self.executor.run(xs, ys, scale / self.micro_batches)
        return self._pp_sum(loss)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over `batches` of (mbs x micro-batches) rows, all split into micro-batches
        of one forward-only pipeline pass."""
        k = self.micro_batches
        batches = [
            (x, y) for xs, ys in batches for x, y in zip(xs.chunk(k), ys.chunk(k), strict=True)
        ]
        n = len(batches)
        if n not in self._eval_executors:
            base = self.executor
            assert base is not None
            sched = add_communication(forward_only(base.schedule, n))
            stages = {s: base.stages[s] for s in sched.stages_of(base.rank)}
            self._eval_executors[n] = PipelineExecutor(
                sched,
                base.rank,
                stages,
                base.group,
                base.act_shape,
                base.act_dtype,
                base.device,
                self.forward_context,
            )
        ex = self._eval_executors[n]
        dev = ex.device
        xs = [x.to(dev) for x, _ in batches]
        ys = [y.to(dev) for _, y in batches]
        return self._pp_sum(ex.run(xs, ys, 1.0 / n, train=False)).item()

    def _pp_sum(self, value: torch.Tensor) -> torch.Tensor:
        group = self.mesh.group("pp")
        if group is not None:
            dist.all_reduce(value, group=group)
        return value

    # ------------------------------------------------------------------ gradients

    def sync_context(self, last_micro_batch: bool):
        return contextlib.nullcontext()  # nothing is reduced during backward under pp

    def reduce_and_clip(self, optimizer, max_norm: float) -> torch.Tensor:
        self.sync_fp8_copies()
        self.sync_fp8_replicas()  # over dp, after the step's micro-batches (docstring)
        self.finish_grads()  # sequence-parallel norm weights over tp
        self.sum_shared_grads()
        if isinstance(optimizer, ZeroOneAdamW):
            optimizer.reduce_grads()
            return optimizer.clip_grad_norm(max_norm)
        self._dp_mean_grads()
        return self.clip_grad_norm(max_norm)

    def _grad(self, p: nn.Parameter) -> torch.Tensor:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def sum_shared_grads(self) -> None:
        """Sum the gradients of every parameter's copies (tied embeddings, DualPipe)."""
        for copies in self.copies.values():
            if len(copies) > 1:
                total = sum(self._grad(p) for p in copies)
                for p in copies:
                    p.grad = total.clone()
        for ranks, names in self.shared_groups:
            group = self.mesh.subgroup("pp", ranks)
            if group is None:
                continue
            flat = torch.cat([self._grad(self.copies[n][0]).reshape(-1) for n in names])
            dist.all_reduce(flat, group=group)
            offset = 0
            for n in names:
                for p in self.copies[n]:
                    g = self._grad(p)
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += self.copies[n][0].numel()

    @torch.no_grad()
    def sync_fp8_copies(self) -> None:
        """Make every copy of a module's delayed-scaling state equal (module docstring): the
        elementwise max of the copies' amax histories (slot i of each is its i-th most recent
        quantization, and both copies quantize equally often) and the min of their scales,
        in memory for copies on this rank and by an all-reduce over the pipeline ranks that
        hold the others. Under `update="step"` only the current slot differs (each copy's
        max over its micro-batches) and the scales are equal: the max is the step's."""
        local: dict[str, list[torch.Tensor]] = defaultdict(list)
        for chunk in self.inner.chunks.values():
            for key, buf in fp8_buffers(chunk).items():
                local[key].append(buf)
        ops = {"fp8_amax_history": torch.maximum, "fp8_scale": torch.minimum}
        for key, bufs in local.items():
            if len(bufs) > 1:
                merged = functools.reduce(ops[key.rsplit(".", 1)[1]], bufs)
                for b in bufs:
                    b.copy_(merged)
        for ranks, keys in self.fp8_shared:
            group = self.mesh.subgroup("pp", ranks)
            if group is None:
                continue
            histories = [local[k][0] for k in keys if k.endswith(".fp8_amax_history")]
            scales = [local[k][0] for k in keys if k.endswith(".fp8_scale")]
            all_reduce_scaling_state(histories, scales, group)
            for k in keys:
                for b in local[k][1:]:
                    b.copy_(local[k][0])

    def _dp_mean_grads(self) -> None:
        """Average the gradients over dp (expert weights were reduced over their own
        replicas in `finish_grads`)."""
        group = self.mesh.group("dcp")
        if group is None:
            return
        experts = set(self.experts.names) if self.experts is not None else set()
        grads = [self._grad(p) for n, p in self.inner.named_parameters() if n not in experts]
        all_reduce_coalesced(grads, group)
        torch._foreach_div_(grads, self.mesh.size("dcp"))

    # ------------------------------------------------------------------ state

    def state_params(self) -> list[tuple[str, nn.Parameter]]:
        return self.owned

    def local_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, ps in self.copies.items() for p in ps]

    def gather_state(self, state: dict) -> dict:
        group = self.mesh.group("pp")
        if group is None:
            return state
        parts: list[dict | None] = [None] * self.mesh.size("pp")
        dist.all_gather_object(parts, state, group=group)
        merged: dict = {}
        for part in parts:
            merged.update(part or {})
        return merged

    def fp8_state_dict(self) -> dict[str, torch.Tensor]:
        """The FP8 scaling state of the whole model by global name, on every rank (a
        collective over pp): each module's from the first (rank, chunk) holding it."""
        local: dict[str, torch.Tensor] = {}
        for _, chunk in sorted(self.inner.chunks.items(), key=lambda kv: int(kv[0])):
            for key, value in fp8_state_dict(chunk).items():
                local.setdefault(key, value)
        group = self.mesh.group("pp")
        if group is None:
            return local
        parts: list[dict | None] = [None] * self.mesh.size("pp")
        dist.all_gather_object(parts, local, group=group)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:  # rank order: the first holder wins
            for key, value in (part or {}).items():
                merged.setdefault(key, value)
        return merged

    def load_fp8_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Give every chunk (every copy) its modules' state from a whole-model dict."""
        for chunk in self.inner.chunks.values():
            mine = fp8_state_keys(chunk)
            missing = sorted(set(mine) - set(state))
            if missing:
                raise KeyError(f"FP8 scaling state missing for {missing[:4]}")
            load_fp8_state_dict(chunk, {k: state[k] for k in mine})


def build_pipeline(
    cfg: JobConfig,
    mesh: ParallelMesh,
    device: torch.device,
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> PipelineModel:
    """This rank's chunks of the job's model, initialised, with the executor that runs them."""
    par = cfg.parallel
    pp, pp_rank = mesh.size("pp"), mesh.rank("pp")
    tp = mesh.size("tp")
    m = pipeline_microbatches(par)
    schedule = build_schedule(par.pp_schedule, pp, m, par.vpp)
    if par.ep_overlap:  # forward-backward pairs for the executor to overlap
        schedule = pair_forward_backward(schedule)
    schedule = add_communication(schedule)
    chunk_of = schedule.replica_of  # stage -> chunk (DualPipe: both copies, one chunk)
    n_chunks = len(set(chunk_of))
    ranges = layer_ranges(cfg.model.n_layers, n_chunks, par.pp_layers)
    fam = family(cfg.model.family)
    meta = build_model(cfg.model)

    def cut(c: int) -> nn.Module:
        return fam.pipeline_chunk(copy.deepcopy(meta), ranges[c], c == 0, c == n_chunks - 1)

    # Who holds what, from the layout alone (the same answer on every rank).
    names = {c: [n for n, _ in cut(c).named_parameters()] for c in range(n_chunks)}
    holders: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for s in range(schedule.n_stages):
        for n in names[chunk_of[s]]:
            holders[n].add((schedule.placement[s], chunk_of[s]))

    mine = sorted({chunk_of[s] for s in schedule.stages_of(pp_rank)})
    chunks, sp_params, expert_names = {}, [], []
    ep_groups = mesh.expert_groups(par.ep) if par.ep > 1 else None  # a collective
    for c in mine:  # the parallelize recipe, chunk by chunk
        chunk = cut(c)
        sharding = parallelize(chunk, cfg, mesh, fam, partial=True)
        sp_params += [f"chunks.{c}.{n}" for n in sharding.sp_params]
        if sharding.experts is not None:
            expert_names += [f"chunks.{c}.{n}" for n in sharding.experts.names]
        chunks[c] = chunk
    model = PipelineChunks(chunks, mesh.group("pp") if cfg.model.n_routed_experts else None)
    materialize(model, device, cfg.train.seed)
    select_ops(model, cfg)

    copies: dict[str, list[nn.Parameter]] = defaultdict(list)
    owned = []
    for name, p, c in model.global_names():
        copies[name].append(p)
        if min(holders[name]) == (pp_rank, c):
            owned.append((name, p))
    by_ranks: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for name in sorted(holders):
        ranks = tuple(sorted({r for r, _ in holders[name]}))
        if len(ranks) > 1:
            by_ranks[ranks].append(name)
    shared = sorted(by_ranks.items())
    for ranks, _ in shared:  # a collective: every rank creates every group, in order
        mesh.subgroup("pp", ranks)
    shared = [(r, n) for r, n in shared if pp_rank in r]
    # Delayed-scaling buffers of modules held on several ranks (DualPipe's copies): a module
    # is held where its parameters are.
    fp8_by_ranks: dict[tuple[int, ...], set[str]] = defaultdict(set)
    for c in mine:
        for key in fp8_state_keys(chunks[c]):
            module = key.rsplit(".", 1)[0] + "."
            ranks = tuple(
                sorted({r for n in names[c] if n.startswith(module) for r, _ in holders[n]})
            )
            if len(ranks) > 1:
                fp8_by_ranks[ranks].add(key)
    fp8_shared = [(r, sorted(k)) for r, k in sorted(fp8_by_ranks.items())]

    # this rank's part of a sequence: 1/cp of it, and of that 1/tp under sequence parallelism
    seq = cfg.data.seq_len // par.cp // (tp if par.sp and tp > 1 else 1)
    act_shape = (cfg.train.micro_batch_size, seq, cfg.model.dim)
    stages = {s: model.chunks[str(chunk_of[s])] for s in schedule.stages_of(pp_rank)}
    executor = PipelineExecutor(
        schedule,
        pp_rank,
        stages,
        mesh.group("pp"),
        act_shape,
        torch.float32,
        device,
        forward_context,
        overlap=par.ep_overlap,
    )
    counted = {id(p) for _, p in owned}
    return PipelineModel(
        module=model,
        inner=model,
        mesh=mesh,
        zero=par.zero,
        sp_params=sp_params,
        norm_skip=frozenset(id(p) for p in model.parameters() if id(p) not in counted),
        executor=executor,
        micro_batches=m,
        copies=dict(copies),
        shared_groups=shared,
        fp8_shared=fp8_shared,
        owned=owned,
        forward_context=forward_context,
        experts=(
            ExpertParallelism(ep_groups[0], ep_groups[1], mesh.size("dcp"), expert_names)
            if ep_groups is not None
            else None
        ),
    )
