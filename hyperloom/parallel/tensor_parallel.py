"""Tensor and sequence parallelism (Megatron-LM style), as layers applied from outside.

Tensor parallelism (arXiv 1909.08053) pairs a column-parallel linear (split along output
features) with a row-parallel one (split along input features) whose partial outputs are
summed. Sequence parallelism (arXiv 2205.05198) also splits the norms and residuals along the
sequence: the all-reduce becomes a reduce-scatter plus an all-gather, same bytes, 1/tp of those
activations. We write the layers rather than use DTensor's `parallelize_module` because the
engine must own the GEMMs: FP8 quantizes on a chosen side of each collective, and Zero Bubble
splits a linear's backward into B and W. The collectives are autograd functions whose
backward is the conjugate collective. Activations are (batch, seq, features).

The output head is vocab-parallel; with the fused cross-entropy even this rank's logits slice
exists only one chunk of tokens at a time.

A family's plan maps module paths to styles, which `apply_tensor_parallel` interprets:
"colwise" / "rowwise" linears; "tp_input" (a block's input made whole once for its
column-parallel linears); "vocab_embedding" / "vocab_head"; "sp_norm" (a norm on a sequence
slice, its weight gradient summed over tp); "colwise_tp_input" (a column-parallel linear that
sums its own input gradient, its input whole already); "tp_output_grad" (a replicated module
feeding only this rank's shards: its output gradient summed before its backward);
"tp_partial_grad" (a replicated module whose weight gradient is a partial sum, summed after
backward); "sp_gather" (under sp a module's input gathered whole, the gather's backward keeping
this rank's slice of a gradient its consumers made whole); "sp_partial_grad" (a replicated
module that under sp sees only this rank's tokens: its weight gradient summed after backward).

Under sp, modules with a `sequence` attribute get a `SequenceShard` (MoE layers reduce their
loads and balance losses over it). Submodules a model names in `whole_sequence_modules` run on
whole sequences, tensor-parallel without sp (DeepSeek's MTP, which reads token i + k).
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyperloom.engine.fp8.modules import Fp8State, active_recipe, fp8_linear
from hyperloom.engine.fp8.recipes import BlockwiseScaling, MXFP8Scaling
from hyperloom.engine.ops import linear_cross_entropy
from hyperloom.engine.ops.cross_entropy import cross_entropy_reference, token_weights
from hyperloom.models.shard import Shard, set_shard, whole_sequence

SEQ_DIM = 1
IGNORE_INDEX = -100  # labels that take no part in the loss (prompts, padding)


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return _all_reduce_op(x, group, dist.ReduceOp.SUM)


def _all_reduce_op(x: torch.Tensor, group, op) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_world(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=SEQ_DIM)  # (b, s, ...) from tp x (b, s/tp, ...)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    chunks = [c.contiguous() for c in x.chunk(_world(group), dim=SEQ_DIM)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out  # (b, s/tp, ...): this rank's sequence slice of the sum


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the group ("f" in Megatron)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward ("g" in Megatron)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    """Sequence-parallel -> full sequence; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _GatherSeqWholeGrad(torch.autograd.Function):
    """Sequence-parallel -> full sequence for consumers that make its gradient whole on every
    rank (Megatron's gather with `tensor_parallel_output_grad=False`): backward keeps this
    rank's slice, no communication."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.local = group, x.shape[SEQ_DIM]
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        start = _rank(ctx.group) * ctx.local
        return grad.narrow(SEQ_DIM, start, ctx.local).contiguous(), None


class _ReduceScatterSeq(torch.autograd.Function):
    """Partial sums over the full sequence -> this rank's summed sequence slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    """Full sequence, alike on every rank -> this rank's slice; backward all-gathers the
    gradient, so the producer (alike on every rank) gets the whole one (Megatron's
    `scatter_to_sequence_parallel_region`)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.chunk(_world(group), dim=SEQ_DIM)[_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


def copy_to_tp(x, group):
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_seq(x, group):
    return x if group is None else _GatherSeq.apply(x, group)


def reduce_scatter_seq(x, group):
    return x if group is None else _ReduceScatterSeq.apply(x, group)


def gather_seq_whole_grad(x, group):
    return x if group is None else _GatherSeqWholeGrad.apply(x, group)


class SequenceShard:
    """This rank's 1/tp of every sequence under sequence parallelism, for a module that
    works on it and needs whole-sequence quantities (`sequence` attribute, set by
    `apply_tensor_parallel`; the model code cannot import this package)."""

    def __init__(self, group):
        self.group, self.size = group, _world(group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s / tp, ...) -> (b, s, ...) for a region every tp rank computes alike (so its
        gradient is whole on each): the backward keeps this rank's slice."""
        return gather_seq_whole_grad(x, self.group)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s, ...) alike on every rank -> this rank's (b, s / tp, ...); the backward
        gathers the gradient whole (a vision-language model's merged embeddings)."""
        return _ScatterSeq.apply(x, self.group)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the tp ranks of a per-slice quantity, for a loss every tp rank
        computes alike from it: the backward is the identity (each slice gets that loss's
        gradient once)."""
        return reduce_from_tp(x, self.group)


def scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's sequence slice of a tensor every rank holds whole (no communication)."""
    if group is None:
        return x
    return x.chunk(_world(group), dim=SEQ_DIM)[_rank(group)].contiguous()


def _shard_param(full_shape: tuple[int, ...], dim: int, group, like: torch.Tensor) -> nn.Parameter:
    parts, index = _world(group), _rank(group)
    if full_shape[dim] % parts:
        raise ValueError(f"dimension {dim} of {full_shape} does not split into {parts} parts")
    shape = list(full_shape)
    shape[dim] //= parts
    p = nn.Parameter(torch.empty(shape, dtype=like.dtype, device=like.device))
    set_shard(p, Shard(dim, index, parts))
    return p


class _TPLinear(Fp8State, nn.Module):
    """FP8 for a tensor-parallel linear made from an `Fp8Linear` (else plain `F.linear`).

    The FP8 engine gets the shard and a callback that all-reduces (MAX) an amax over the
    group for the roles whose tensor is sharded, so per-tensor recipes (delayed, current)
    use the whole tensor's scale and delayed histories stay identical across ranks.
    Blockwise / MXFP8 scales are local to their blocks: equal to one process's when the
    sharded dimension is a whole number of blocks, which is checked here. Rowwise scales span
    the contraction dimension, which one of each layer's GEMMs has sharded: the engine
    all-reduces (MAX) those row amaxes through the same callback.
    """

    sharded_roles: tuple[str, ...] = ()

    def _init_fp8(self, linear: nn.Module, group, shard_size: int, kind: str) -> None:
        recipe = getattr(linear, "recipe", None)
        if recipe is None:
            self.recipe, self.fp8_amax_history, self.fp8_scale = None, None, None
            return
        blocked = isinstance(recipe, (BlockwiseScaling, MXFP8Scaling))
        if blocked and _world(group) > 1 and shard_size % recipe.block:
            raise ValueError(
                f"FP8 {recipe.name} under tensor parallelism: the {kind} shard of "
                f"{tuple(linear.weight.shape)} has {shard_size} features, not a multiple of "
                f"the {recipe.block}-element scale block, so scale blocks would straddle "
                f"ranks; make the sharded dimension a multiple of tp * {recipe.block}"
            )
        self._setup_fp8(recipe, 1, getattr(linear, "fp8_activation", False), linear.weight.device)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        recipe = None if self.recipe is None else active_recipe(self.recipe)
        if recipe is None:
            return F.linear(x, self.weight, bias)
        group = self.group
        reduce = None
        if group is not None:

            def reduce_max(t: torch.Tensor) -> torch.Tensor:
                return _all_reduce_op(t, group, dist.ReduceOp.MAX)

            reduce = dict.fromkeys(self.sharded_roles, reduce_max)
        states = self._states(recipe)
        return fp8_linear(x, self.weight, bias, recipe, states, self.fp8_activation, reduce)


class ColumnParallelLinear(_TPLinear):
    """y = x W_iᵀ for this rank's rows W_i of W (output features split across the group).

    The input must already be whole and "copied into" the group: `prepare_tp_input` on the
    enclosing block does that once for q, k and v (or w1 and w3) instead of once per linear.
    Under FP8 the weight and the output gradient are the sharded tensors.
    """

    sharded_roles = ("weight", "grad_output")

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        self.weight = _shard_param(tuple(linear.weight.shape), 0, group, linear.weight)
        # a bias splits with the output features
        self.bias = None
        if linear.bias is not None:
            self.bias = _shard_param(tuple(linear.bias.shape), 0, group, linear.bias)
        self._init_fp8(linear, group, self.weight.shape[0], "output-feature")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)  # (b, s, out / tp)


def prepare_tp_input(module: nn.Module, group, sequence_parallel: bool) -> None:
    """Make `module`'s first input whole on every rank of the group, once per call:
    all-gather along the sequence under sequence parallelism, else the identity whose
    backward sums the gradient over the group."""

    def hook(_module, args):
        x = args[0]
        x = gather_seq(x, group) if sequence_parallel else copy_to_tp(x, group)
        return (x, *args[1:])

    module.register_forward_pre_hook(hook)


def prepare_sp_gather(module: nn.Module, group) -> None:
    """Gather `module`'s first input along the sequence (sequence parallelism), for a module
    whose consumers of that input make its gradient whole on every rank themselves (MLA's
    down-projections, "tp_output_grad"): the gather's backward keeps this rank's slice where
    `prepare_tp_input`'s reduce-scatters partial sums."""

    def hook(_module, args):
        return (gather_seq_whole_grad(args[0], group), *args[1:])

    module.register_forward_pre_hook(hook)


def prepare_copy_input(module: nn.Module, group) -> None:
    """The identity on `module`'s first input whose backward sums its gradient over the
    group (the input is whole on every rank already; under sp an enclosing "sp_gather"
    gathered it)."""

    def hook(_module, args):
        return (copy_to_tp(args[0], group), *args[1:])

    module.register_forward_pre_hook(hook)


def prepare_tp_output_grad(module: nn.Module, group) -> None:
    """Sum the gradient of `module`'s output over the group before `module`'s backward runs:
    the identity forward, an all-reduce backward (Megatron's "copy to tensor-parallel
    region", placed after a replicated module instead of before a column-parallel one).

    For a replicated module whose output feeds only this rank's shards (MLA's low-rank
    down-projections): every rank's backward then sees the whole output gradient, so the
    module's weight gradient is whole on every rank, its input gradient needs no further
    sum, and an FP8 quantization of that output gradient is the one process's."""

    def hook(_module, _args, out):
        return copy_to_tp(out, group)

    module.register_forward_hook(hook)


class RowParallelLinear(_TPLinear):
    """y = Σ_i x_i W_iᵀ over the group, W_i this rank's columns (input features split).
    Under FP8 the input and the weight are the sharded tensors; FP8 GEMM outputs are
    high precision, so the partial sums are reduced in high precision."""

    sharded_roles = ("input", "weight")

    def __init__(self, linear: nn.Linear, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard_param(tuple(linear.weight.shape), 1, group, linear.weight)
        # a bias is whole on every rank, added once after the sum (under sp to this rank's
        # tokens: its gradient is then a partial sum, `apply_tensor_parallel` says so)
        self.bias = linear.bias
        self._init_fp8(linear, group, self.weight.shape[1], "input-feature")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self._linear(x)  # (b, s, out), this rank's share of the sum
        if self.sequence_parallel:
            out = reduce_scatter_seq(partial, self.group)  # (b, s/tp, out)
        else:
            out = reduce_from_tp(partial, self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary's rows; lookups of ids outside
    the slice contribute zeros, and the sum over the group assembles every embedding."""

    def __init__(self, embedding: nn.Embedding, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard_param(tuple(embedding.weight.shape), 0, group, embedding.weight)
        self.vocab_start = _rank(group) * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, dim)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_seq(out, self.group)  # (b, s/tp, dim)
        return reduce_from_tp(out, self.group)


class VocabParallelHead(nn.Module):
    """Logits for this rank's vocabulary slice, (b, s, vocab / tp). With tied embeddings it
    borrows the vocab-parallel embedding's weight (same slice) without registering it."""

    def __init__(self, weight_source: nn.Module, group, sequence_parallel: bool, tied: bool):
        super().__init__()
        self.group, self.sequence_parallel, self.tied = group, sequence_parallel, tied
        if tied:
            object.__setattr__(self, "_source", weight_source)  # not a submodule: no new keys
        else:
            self.weight = _shard_param(
                tuple(weight_source.weight.shape), 0, group, weight_source.weight
            )

    def _input(self, h: torch.Tensor, whole_sequence: bool) -> torch.Tensor:
        if self.sequence_parallel and not whole_sequence:
            return gather_seq(h, self.group)
        return copy_to_tp(h, self.group)

    def forward(self, h: torch.Tensor, whole_sequence: bool = False) -> torch.Tensor:
        weight = self._source.weight if self.tied else self.weight
        return F.linear(self._input(h, whole_sequence), weight)

    def loss(
        self,
        h: torch.Tensor,
        labels: torch.Tensor,
        impl: str,
        chunk_tokens: int = 0,
        whole_sequence: bool = False,
        reduction: str = "mean",
    ):
        """Cross-entropy of this head on h against labels (b, s), vocab-parallel: chunked
        and fused with the projection unless `impl` is "reference".
        `whole_sequence`: h holds whole sequences under sp too (copied, not gathered)."""
        if impl == "reference":
            logits = self(h, whole_sequence)
            return vocab_parallel_cross_entropy(logits, labels, self.group, reduction)
        weight = self._source.weight if self.tied else self.weight
        h = self._input(h, whole_sequence)
        group = self.group

        def all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
            reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
            return _all_reduce_op(t, group, reduce_op)

        return linear_cross_entropy(
            h,
            weight,
            labels,
            chunk_tokens=chunk_tokens,
            vocab_start=_rank(group) * weight.shape[0],
            all_reduce=all_reduce if group is not None else None,
            impl=impl,
            reduction=reduction,
        )


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary (Megatron's
    `vocab_parallel_cross_entropy`): global max, global Σexp and the target's logit are each
    one all-reduce of a (tokens,) tensor; backward is softmax − one-hot on the local slice."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start):
        in_dtype = logits.dtype
        logits = logits.float()  # (n, v_local)
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        local = labels - vocab_start
        inside = (local >= 0) & (local < logits.shape[-1])
        target = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        target = target.masked_fill(~inside, 0.0)
        dist.all_reduce(target, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target  # (n,)
        ctx.save_for_backward(exp, sum_exp, local, inside)
        ctx.in_dtype = in_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, local, inside = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)  # softmax on the local slice
        rows = torch.arange(grad.shape[0], device=grad.device)[inside]
        grad[rows, local[inside]] -= 1.0
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group, reduction: str = "mean"
) -> torch.Tensor:
    """Token cross-entropy from vocab-sharded logits (b, s, v/tp) and labels (b, s), reduced
    as `reduction` says (engine.ops.token_weights); labels -100 are ignored."""
    if group is None:
        return cross_entropy_reference(logits, labels, reduction=reduction)
    vocab_start = _rank(group) * logits.shape[-1]
    losses = _VocabParallelCE.apply(logits.flatten(0, 1), labels.flatten(), group, vocab_start)
    if reduction == "mean" and bool((labels != IGNORE_INDEX).all()):
        return losses.mean()  # the text families' plain mean, summed as before
    return (losses * token_weights(labels, IGNORE_INDEX, reduction)).sum()


STYLES = (
    "colwise",
    "rowwise",
    "tp_input",
    "colwise_tp_input",
    "tp_output_grad",
    "tp_partial_grad",
    "vocab_embedding",
    "vocab_head",
    "sp_norm",
    "sp_gather",
    "sp_partial_grad",
)


def _modules_matching(model: nn.Module, pattern: str) -> list[str]:
    return [name for name, _ in model.named_modules() if fnmatch.fnmatchcase(name, pattern)]


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def apply_tensor_parallel(
    model: nn.Module,
    plan: dict[str, str],
    group,
    sequence_parallel: bool,
    partial: bool = False,
) -> list[str]:
    """Swap in the plan's parallel modules (model may be on the meta device).

    `partial`: the model is a pipeline chunk, so plan entries may match nothing (a middle
    chunk has no embedding and no head). Returns the names of the parameters whose gradients
    must be summed over the group after backward (norm weights under sequence parallelism).
    Modules under the model's `whole_sequence_modules` get their styles without sp.
    """
    sp_params: list[str] = []
    whole = whole_sequence(model)
    if sequence_parallel:
        shard = SequenceShard(group)
        for name, m in model.named_modules():
            if hasattr(m, "sequence") and not whole(name):
                m.sequence = shard
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"unknown tensor-parallel style {style!r} for {pattern!r}")
        paths = _modules_matching(model, pattern)
        tied_head = style == "vocab_head" and getattr(model, pattern, 1) is None
        if not paths and not tied_head and not partial:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} matches no module")
        if tied_head:  # tied embeddings: the head borrows them
            emb = next((m for m in model.modules() if isinstance(m, VocabParallelEmbedding)), None)
            if emb is None:  # a pipeline chunk without the embedding has no head either
                continue
            _set_submodule(model, pattern, VocabParallelHead(emb, group, sequence_parallel, True))
            continue
        for path in paths:
            old = model.get_submodule(path)
            sp = sequence_parallel and not whole(path)
            if style == "colwise":
                _set_submodule(model, path, ColumnParallelLinear(old, group))
            elif style == "rowwise":
                _set_submodule(model, path, RowParallelLinear(old, group, sp))
                if sp and old.bias is not None:
                    sp_params.append(f"{path}.bias")
            elif style == "vocab_embedding":
                _set_submodule(model, path, VocabParallelEmbedding(old, group, sp))
            elif style == "vocab_head":
                new = VocabParallelHead(old, group, sp, tied=False)
                _set_submodule(model, path, new)
            elif style == "tp_input":
                prepare_tp_input(old, group, sp)
            elif style == "colwise_tp_input":
                new = ColumnParallelLinear(old, group)
                prepare_copy_input(new, group)
                _set_submodule(model, path, new)
            elif style == "tp_output_grad":
                prepare_tp_output_grad(old, group)
            elif style == "sp_gather" and sp:
                prepare_sp_gather(old, group)
            elif style == "tp_partial_grad" or (style in ("sp_norm", "sp_partial_grad") and sp):
                sp_params.extend(f"{path}.{n}" for n, _ in old.named_parameters())
    return sp_params
