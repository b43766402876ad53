"""Expert parallelism: each rank of an expert-parallel group holds E / ep experts, and the
tokens routed to an expert travel to the rank that holds it.

`ep` folds over data parallelism rather than adding a mesh dimension (Megatron-Core's
"parallel folding", arXiv 2504.14960; DeepSeek-V3 trains EP64 over its DP ranks): consecutive
groups of `ep` data-parallel ranks form an expert-parallel group, and the ranks holding the
same experts form the expert-data-parallel group of size dp / ep.

The MoE layer routes and sorts its tokens as on one device; its experts module is swapped for
an `ExpertParallelExperts` that keeps the contract "rows for the experts in, their outputs
out, same order" and hides the travel, by one of two dispatchers whose backward is the
transposed collective:

- all-to-all (GShard, arXiv 2006.16668; Megatron's `alltoall`; DeepSeek's DeepEP): exchange
  counts, send each rank its experts' rows, regroup for one grouped GEMM, send outputs back;
- all-gather (Megatron's `allgather`, for small ep or large top-k): every rank gathers the
  group's rows, runs its experts, and a reduce-scatter returns each rank its rows' outputs.
  More bytes, only fixed-size collectives.

An expert weight's local gradient already sums the ep ranks' contributions; summing it over
the expert-data-parallel group and dividing by dp gives the one-process gradient
(`ExpertParallelism.reduce_grads`), so DDP leaves expert weights alone. Expert weights carry
`Shard(0, ep_rank, ep, over="ep")`, so checkpoints gather and slice them whole, and FP8
per-expert histories take the same road (`fp8_whole`, `fp8_piece`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hyperloom.models.experts import Experts
from hyperloom.models.shard import Shard, set_shard
from hyperloom.parallel import tensor_parallel as tpl
from hyperloom.parallel.mesh import all_reduce_coalesced
from hyperloom.parallel.overlap import wait_overlapped

DISPATCHERS = ("alltoall", "allgather")


class _AllToAll(torch.autograd.Function):
    """Rows of x split `send` ways out, `recv` ways in; backward sends gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Started asynchronously and waited for through `overlap.wait_overlapped`: inside a
    `Duet` the other micro-batch computes while the rows travel."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), recv, send, group=group, async_op=True)
    wait_overlapped(work, "all-to-all")
    return out


def _regroup(blocks: torch.Tensor) -> torch.Tensor:
    """Row permutation that takes rows laid out in blocks (a, b) — blocks[a, b] rows each, a
    major — to (b, a) order. blocks (A, B) int64 -> (sum,) int64 indices into the rows."""
    sizes = blocks.flatten()
    starts = sizes.cumsum(0) - sizes  # (A * B,) first row of each block in (a, b) order
    sizes_t = blocks.t().flatten()  # (B * A,) block sizes in (b, a) order
    starts_t = starts.view(blocks.shape).t().flatten()
    offset = torch.arange(int(sizes_t.sum()), device=blocks.device)
    offset = offset - (sizes_t.cumsum(0) - sizes_t).repeat_interleave(sizes_t)
    return starts_t.repeat_interleave(sizes_t) + offset


class ExpertParallelExperts(Experts):
    """This rank's E / ep experts behind the `Experts` contract: rows for all E experts in
    (grouped by global expert id), their outputs out, in the same order."""

    def __init__(self, experts: Experts, group, ep_rank: int, ep: int, dispatcher: str):
        n_experts, hidden, dim = experts.w1.shape
        if n_experts % ep:
            raise ValueError(f"{n_experts} experts do not split over ep = {ep} ranks")
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"unknown expert dispatcher {dispatcher!r}; known: {DISPATCHERS}")
        with torch.device(experts.w1.device):  # meta: a 671B model's experts allocate nothing
            super().__init__(n_experts // ep, dim, hidden)
        for p in self.parameters():
            set_shard(p, Shard(0, ep_rank, ep, over="ep"))  # this rank's experts
        self.group, self.ep, self.ep_rank, self.n_local = group, ep, ep_rank, n_experts // ep
        self.dispatcher = dispatcher
        self.grouped_mm, self.ops = experts.grouped_mm, experts.ops
        if experts.recipe is not None:  # FP8 GEMMs; delayed: this rank's experts' histories
            self.enable_fp8(experts.recipe, experts.fp8_activation)

    def fp8_whole(self, buf: torch.Tensor) -> torch.Tensor:
        """A per-expert scaling buffer (E / ep, ...) gathered into the whole (E, ...), rank
        order = expert order, as checkpoints gather the weights (a collective over ep)."""
        return tpl.gather_seq(buf.detach()[None], self.group)[0]  # (E, ...)

    def fp8_piece(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's experts' rows of a whole (E, ...) scaling buffer."""
        if whole.ndim == 0 or whole.shape[0] != self.n_local * self.ep:
            raise ValueError(
                f"expert scaling state of shape {tuple(whole.shape)} does not split into "
                f"ep = {self.ep} ranks of {self.n_local} experts ({self.n_local * self.ep} rows)"
            )
        return whole.chunk(self.ep)[self.ep_rank]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, dim) holding counts[e] rows for global expert e -> (N, dim)."""
        if self.dispatcher == "alltoall":
            return self._all_to_all(x, counts)
        return self._all_gather(x, counts)

    def _all_to_all(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, self.n_local
        send = counts.view(ep, local)  # (ep, local): rows for rank j's l-th expert
        recv = torch.empty_like(send)  # (ep, local): rows rank j sends for my l-th expert
        # Waited for at once: the rows' exchange needs it, and as a lane switch of its own it
        # would leave the forward lane one switch per layer ahead of the backward's two.
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
        got = _AllToAll.apply(x, send_rows, recv_rows, self.group)  # (M, dim), (j, l) order
        perm = _regroup(recv)  # (M,) -> (l, j) order: one run of rows per local expert
        out = super().forward(got[perm], recv.sum(0))  # (M, dim)
        back = torch.empty_like(out).index_copy(0, perm, out)  # (M, dim) in (j, l) order
        return _AllToAll.apply(back, recv_rows, send_rows, self.group)  # (N, dim)

    def _all_gather(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        me = dist.get_rank(self.group)
        mine = (me * self.n_local, (me + 1) * self.n_local)  # my experts' columns
        rows, row_counts, undo = gather_rows(x, counts, self.group, mine)
        return scatter_rows(super().forward(rows, row_counts), undo, self.group)


def gather_rows(x: torch.Tensor, counts: torch.Tensor, group, experts: tuple[int, int]):
    """Every rank's rows for experts [lo, hi) of a group: x (N, dim) holds counts[e] rows per
    expert e on this rank. The group's rows are all-gathered (padded to the longest rank's)
    and regrouped in (expert, source rank) order; returns (those rows (M, dim), rows per
    expert (hi - lo,), what `scatter_rows` needs). The gather's backward sums the rows'
    gradient over the group."""
    size, n = dist.get_world_size(group), x.shape[0]
    parts = [torch.empty_like(counts) for _ in range(size)]
    dist.all_gather(parts, counts.contiguous(), group=group)
    everyone = torch.stack(parts)  # (size, E): rows each rank holds per expert
    width = int(everyone.sum(1).max())  # rows of the longest rank: pad everyone to it
    padded = torch.cat([x, x.new_zeros(width - n, x.shape[1])])  # (width, dim)
    gathered = tpl.gather_seq(padded[None], group)[0]  # (size * width, dim), rank major
    lo, hi = experts
    wanted = everyone[:, lo:hi]  # (size, hi - lo) rows per (rank, expert)
    before = everyone[:, :lo].sum(1)  # (size,) rows of lower experts, per rank
    base = torch.arange(size, device=x.device) * width + before  # (size,) first wanted row
    take = _shift(wanted, base)  # (M,) indices into the gathered rows
    return gathered[take], wanted.sum(0), (take, gathered.shape[0], n)


def scatter_rows(out: torch.Tensor, undo, group) -> torch.Tensor:
    """Outputs (M, dim) of `gather_rows`'s rows back to their ranks, summed over the group:
    this rank's (N, dim). Backward: the gradient gathered."""
    take, total, n = undo
    scattered = out.new_zeros(total, out.shape[1]).index_copy(0, take, out)
    return tpl.reduce_scatter_seq(scattered[None], group)[0][:n]


def _shift(blocks: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Row indices, in (l, j) order, of blocks (ep, local) that sit consecutively from
    base[j] in rank j's part of a gathered tensor."""
    perm = _regroup(blocks)  # indices into the rank-major concatenation of the blocks
    per_rank = blocks.sum(1)  # (ep,)
    rank_of = torch.arange(blocks.shape[0], device=blocks.device).repeat_interleave(per_rank)
    first = per_rank.cumsum(0) - per_rank  # (ep,) where rank j's rows start in the concat
    return base[rank_of[perm]] + perm - first[rank_of[perm]]


@dataclass
class ExpertParallelism:
    """What the layout needs to know about the expert weights after they were split."""

    group: object  # the ep group (this rank's experts' peers)
    data_group: object | None  # ranks holding the same experts (size dp / ep), or None
    dp: int  # data-parallel size: expert gradients are averaged over the whole of it
    names: list[str]  # expert parameter names

    def reduce_grads(self, model: nn.Module) -> None:
        """Expert gradients: summed over the expert-data-parallel group, divided by dp (see
        the module docstring: then they equal the one-process gradient)."""
        grads = [model.get_parameter(n).grad for n in self.names]
        grads = [g for g in grads if g is not None]
        if not grads:
            return
        all_reduce_coalesced(grads, self.data_group)
        torch._foreach_mul_(grads, 1.0 / self.dp)


def apply_expert_parallel(
    model: nn.Module,
    group,
    data_group,
    ep_rank: int,
    ep: int,
    dp: int,
    dispatcher: str,
    partial: bool = False,
) -> ExpertParallelism:
    """Swap every expert bank (`models.experts.Experts`) for this rank's E / ep of its
    experts (model on meta). `partial`: the model is a pipeline chunk, which may hold no MoE
    layer."""
    names = []
    banks = [(path, m) for path, m in model.named_modules() if isinstance(m, Experts)]
    for path, bank in banks:
        local = ExpertParallelExperts(bank, group, ep_rank, ep, dispatcher)
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, local)
        names.extend(f"{path}.{n}" for n, _ in local.named_parameters())
    if not names and not partial:
        raise ValueError("parallel.ep > 1 needs a Mixture-of-Experts model (no MoE layer found)")
    return ExpertParallelism(group, data_group, dp, names)
