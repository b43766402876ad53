"""Context parallelism, the recipe's third slot: every sequence split over the cp ranks.

**Sharding.** With causal attention the late positions attend to more keys than the early
ones, so the sequence is cut into 2 x cp chunks and rank i holds chunks i and 2cp-1-i: every
rank then does the same share of the causal triangle (Megatron-LM's and torchtitan's load
balance). Inputs and labels are sharded by `ContextShard.shard`; RoPE reads the rows of the
rank's global positions (`rope_rows`); a rank's loss is its tokens' mean, weighted so that
the mean over cp is the whole sequence's mean (`weight_loss`). Gradients and optimizer state
reduce over dp x cp (`ParallelMesh`'s "dcp" group), as Megatron's does.

**Attention over cp** (`parallel.cp_comm`), inside each attention core:

- ring (Ring Attention, Liu et al. arXiv 2310.01889): K/V blocks travel around the cp ranks
  (async send to rank+1, receive from rank-1, started before the current block's compute so
  the two overlap); each block's partial result is merged in float32 by its logsumexp. With
  the load balance, block j < i is seen in full by both local chunks' queries for half its
  keys, block j > i by the second chunk only, so every step after the first is half a block.
  The backward passes K/V around again with their float32 gradient accumulators, which come
  home after cp hops. Blocks run PyTorch's tiled CPU attention kernel where it applies, else
  float32 math (`engine.ops.attention.attention_block`). Written here, not torch's
  experimental `context_parallel`, for control: grouped-query heads without repeating K/V,
  MLA's unequal head widths and its compressed latent as what travels, FP32 merging.
- all-to-all (DeepSpeed-Ulysses, Jacobs et al. arXiv 2309.14509): q, k, v are exchanged from
  (all heads, local sequence) to (heads / cp, whole sequence), the model's own attention runs
  on the whole sequence (dropout included), and the output goes back: four all-to-alls per
  layer and pass. K/V heads that do not divide by cp are repeated up to the query heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hyperloom.engine.ops.attention import attention_block, attention_block_backward
from hyperloom.models.shard import whole_sequence

FORMS = ("ring", "alltoall")


@dataclass(eq=False)
class ContextShard:
    """This rank's place in its context-parallel group: what the models' attention cores,
    RoPE and loss consult (their `context` attribute; None without cp)."""

    cp: int
    rank: int
    group: object
    comm: str = "ring"

    def __post_init__(self):
        if self.comm not in FORMS:
            raise ValueError(f"parallel.cp_comm must be one of {FORMS}, got {self.comm!r}")
        self.next_peer = dist.get_global_rank(self.group, (self.rank + 1) % self.cp)
        self.prev_peer = dist.get_global_rank(self.group, (self.rank - 1) % self.cp)
        self._rope_key, self._rope_rows = None, None
        self._orders: dict[tuple, torch.Tensor] = {}

    def __deepcopy__(self, memo):  # model copies (DualPipe's two chunks) share the group
        return self

    # ------------------------------------------------------------------ sequence layout

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        """The two chunks (of 2 x cp) that `rank` (default this one) holds."""
        r = self.rank if rank is None else rank
        return r, 2 * self.cp - 1 - r

    def positions(self, local_seq: int, device=None) -> torch.Tensor:
        """Global positions (local_seq,) of this rank's tokens, chunk i then chunk 2cp-1-i."""
        c = local_seq // 2
        first, second = self.chunks()
        idx = torch.arange(c, device=device)
        return torch.cat([first * c + idx, second * c + idx])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a whole-sequence tensor along `dim`."""
        pieces = x.chunk(2 * self.cp, dim=dim)
        first, second = self.chunks()
        return torch.cat([pieces[first], pieces[second]], dim=dim)

    def order(self, local_seq: int, device=None, inverse: bool = False) -> torch.Tensor:
        """Index that puts the rank-major concatenation of every rank's local sequence
        (what an all-gather over cp yields) into natural order, or with `inverse` natural
        order back into rank-major; made once per length and device (every layer asks)."""
        key = (local_seq, str(device), inverse)
        if key not in self._orders:
            c = local_seq // 2
            where = torch.empty(2 * self.cp, dtype=torch.long)
            for r in range(self.cp):
                a, b = self.chunks(r)
                where[a], where[b] = 2 * r, 2 * r + 1
            idx = torch.arange(c)
            index = torch.cat([where[j] * c + idx for j in range(2 * self.cp)])
            self._orders[key] = (torch.argsort(index) if inverse else index).to(device)
        return self._orders[key]

    def rope_rows(self, cos: torch.Tensor, sin: torch.Tensor, seq: int):
        """The RoPE table rows of this rank's `seq` local positions; gathered once for all
        layers (kept while the tables and the length stay the same)."""
        key = (cos.data_ptr(), sin.data_ptr(), seq, cos.device)
        if self._rope_key != key:
            idx = self.positions(seq, cos.device)
            self._rope_rows, self._rope_key = (cos[idx], sin[idx]), key
        return self._rope_rows

    # ------------------------------------------------------------------ loss

    def weight_loss(self, loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's mean loss scaled by cp x its share of the valid labels (ignore_index
        -100 excluded): the mean over cp is then the whole sequence's token mean, as one
        process computes it, also when the ranks hold different numbers of valid labels."""
        counts = (labels != -100).sum().to(torch.float32).reshape(1)
        total = counts.clone()
        dist.all_reduce(total, group=self.group)
        return loss * (counts * self.cp / total.clamp(min=1)).squeeze(0)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's part of (b, local_seq, ...) as the whole sequence in natural order,
        differentiable: the backward sums each part's gradient over the ranks (reduce-scatter),
        right for a whole-sequence loss every cp rank computes alike (MTP, below)."""
        whole = _GatherSequence.apply(x, self)  # rank-major
        return whole.index_select(1, self.order(x.shape[1], x.device))

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a replicated-shape value over the cp ranks (a collective)."""
        value = value.detach().clone()
        dist.all_reduce(value, group=self.group)
        return value / self.cp

    # ------------------------------------------------------------------ attention

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Causal attention of the local q (b, hq, s, d) over every rank's k, v (b, hk, s, d /
        dv): `core` (the model's attention on whole sequences) runs under all-to-all."""
        if self.comm == "ring":
            block, unpack = pack_kv(k, v)
            return RingAttention.apply(q, block, self, unpack)
        return ulysses_attention(q, k, v, self, core)

    def latent_attention(self, q, block, expand, weights) -> torch.Tensor:
        """Ring attention that passes MLA's compressed latent `block` (b, s, width) around
        and expands it into K, V with `expand`, whose `weights` get their gradient here."""
        return RingAttention.apply(q, block, self, expand, *weights)


def context_shard(mesh, comm: str) -> ContextShard | None:
    """This rank's `ContextShard` on `mesh` (a `ParallelMesh`), None without cp."""
    if mesh.size("cp") == 1:
        return None
    return ContextShard(mesh.size("cp"), mesh.rank("cp"), mesh.group("cp"), comm)


def apply_context_parallel(model: nn.Module, shard: ContextShard) -> int:
    """Point every module's `context` hook (attention cores and their RoPE, MoE balance
    losses, the model's loss) at `shard`; returns how many modules it reached. Submodules
    the model names in `whole_sequence_modules` keep None: it runs them on whole sequences
    (DeepSeek's MTP, which reads token i + k)."""
    whole = whole_sequence(model)
    hooked = [m for n, m in model.named_modules() if hasattr(m, "context") and not whole(n)]
    for m in hooked:
        m.context = shard
    return len(hooked)


# ---------------------------------------------------------------------- ring


def _exchange(shard: ContextShard, send: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Start sending `send` to the next rank and receiving its like from the previous one."""
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, shard.next_peer, shard.group),
        dist.P2POp(dist.irecv, recv, shard.prev_peer, shard.group),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, Callable]:
    """K (b, hk, s, d) and V (b, hk, s, dv) as one (b, s, hk x (d + dv)) block to pass around
    the ring, and the function that gives them back from such a block (views, no weights)."""
    hk, d, dv = k.shape[1], k.shape[-1], v.shape[-1]
    block = torch.cat([k.transpose(1, 2).flatten(2), v.transpose(1, 2).flatten(2)], dim=-1)

    def unpack(x: torch.Tensor):
        kx, vx = x.split([hk * d, hk * dv], dim=-1)
        return kx.unflatten(-1, (hk, d)).transpose(1, 2), vx.unflatten(-1, (hk, dv)).transpose(1, 2)

    return block, unpack


def _merge(out, lse, rows: slice, o, l):  # noqa: E741 (lse of a block)
    """Fold a block's (o, l) into the running (out, lse) on query rows `rows`, in place."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, l)
    kept = torch.exp(old - new)[..., None]
    out[:, :, rows] = out[:, :, rows] * kept + o * torch.exp(l - new)[..., None]
    lse[:, :, rows] = new


def _step_blocks(shard: ContextShard, step: int, s: int):
    """(query rows, key rows, causal) of step `step`: the block held then came from rank
    (rank - step) mod cp (see the module doc)."""
    half, src = s // 2, (shard.rank - step) % shard.cp
    if step == 0:
        return slice(0, s), slice(0, s), True
    if src < shard.rank:
        return slice(0, s), slice(0, half), False
    return slice(half, s), slice(0, s), False


class RingAttention(torch.autograd.Function):
    """Causal ring attention over the cp group of `shard` (module doc).

    What travels is a block (b, s, width) from which `expand` makes K and V (b, hk, s, d / dv):
    K and V themselves (`pack_kv`), or MLA's compressed latent [c_kv ‖ k_pe], which each rank
    expands with its own copy of wkv_b (`weights`, whose gradient it accumulates), so the ring
    carries kv_lora_rank + rope_dim values per token instead of heads x (d + dv). The backward
    expands again under autograd and sends the block's gradient home with it."""

    @staticmethod
    def forward(ctx, q, block, shard: ContextShard, expand, *weights):
        b, hq, s, _ = q.shape
        out = lse = None
        held = block
        for step in range(shard.cp):
            if step + 1 < shard.cp:  # the next block travels while this one is computed
                incoming, works = _exchange(shard, held.contiguous())
            rows, keys, causal = _step_blocks(shard, step, s)
            k, v = expand(held[:, keys])
            if out is None:  # laid out (b, s, heads, dv) as SDPA's output is: the caller's
                # (b, s, heads * dv) is then a view, not a second copy held for wo's backward
                out = torch.zeros(b, s, hq, v.shape[-1], dtype=torch.float32, device=q.device)
                out = out.transpose(1, 2)
                lse = torch.full((b, hq, s), float("-inf"), dtype=torch.float32, device=q.device)
            o, l = attention_block(q[:, :, rows], k, v, causal)  # noqa: E741
            _merge(out, lse, rows, o, l)
            if step + 1 < shard.cp:
                _wait(works)
                held = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, block, out, lse, *weights)
        ctx.shard, ctx.expand = shard, expand
        return out

    @staticmethod
    def backward(ctx, dout):
        q, block, out, lse, *weights = ctx.saved_tensors
        shard, expand, s = ctx.shard, ctx.expand, q.shape[2]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dw = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
        held = block
        grads = grad_works = None  # the held block's gradient so far, arriving from rank-1
        for step in range(shard.cp):
            if step + 1 < shard.cp:
                incoming, works = _exchange(shard, held.contiguous())
            rows, keys, causal = _step_blocks(shard, step, s)
            with torch.enable_grad():
                leaf = held.detach().requires_grad_()
                k, v = expand(leaf[:, keys])
            dq_b, dk_b, dv_b = attention_block_backward(
                q[:, :, rows], k.detach(), v.detach(), out[:, :, rows], dout[:, :, rows],
                lse[:, :, rows], causal,
            )  # fmt: skip
            dq[:, :, rows] += dq_b
            found = torch.autograd.grad(
                (k, v), (leaf, *weights), (dk_b.to(k.dtype), dv_b.to(v.dtype)), allow_unused=True
            )
            mine = found[0].float()
            for acc, g in zip(dw, found[1:], strict=True):
                if g is not None:
                    acc += g
            if grads is not None:  # the previous hops' share of this block, overlapped
                _wait(grad_works)
                mine += grads
            grads, grad_works = _exchange(shard, mine)
            if step + 1 < shard.cp:
                _wait(works)
                held = incoming
        _wait(grad_works)  # after cp hops each block's gradient is back with its owner
        dw = [g.to(w.dtype) for g, w in zip(dw, weights, strict=True)]
        return dq.to(q.dtype), grads.to(block.dtype), None, None, *dw


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1 (rank-major); backward: the gradient summed over the ranks,
    this rank's part kept. (torch.distributed.nn's all_gather falls back to a scatter
    from global rank 0 on gloo, wrong for a group without it.)"""

    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard, ctx.local = shard, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(shard.cp)]
        dist.all_gather(parts, x.contiguous(), group=shard.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.shard.group)
        return grad.narrow(1, ctx.shard.rank * ctx.local, ctx.local), None


# ---------------------------------------------------------------------- all-to-all


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Piece j of dim 0 to rank j; piece j of the result from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous like x (of a strided x it would keep the strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """(b, h, s, d), local sequence, all heads -> (b, h / cp, cp x s, d), natural order."""
    cp, s = shard.cp, x.shape[2]
    send = x.unflatten(1, (cp, -1)).movedim(1, 0)  # (cp, b, h/cp, s, d): piece j to rank j
    got = _all_to_all(send, shard.group)  # (cp, b, h/cp, s, d): rank j's sequence
    whole = got.movedim(0, 2).flatten(2, 3)  # rank-major sequence
    return whole.index_select(2, shard.order(s, x.device))


def _heads_to_seq(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: (b, h / cp, S, d) -> (b, h, S / cp, d)."""
    cp, s = shard.cp, x.shape[2] // shard.cp
    major = (
        x.index_select(2, shard.order(s, x.device, inverse=True))
        .unflatten(2, (cp, s))
        .movedim(2, 0)
    )  # (cp, b, h/cp, s, d)
    got = _all_to_all(major, shard.group)  # (cp, b, h/cp, s, d): head group j, my sequence
    # laid out (b, s, h, d), as SDPA's output is, so the caller's (b, s, h * d) is a view
    return got.permute(1, 3, 0, 2, 4).flatten(2, 3).transpose(1, 2)


class _Permutation(torch.autograd.Function):
    """An exchange that permutes elements across ranks (`fn`): its gradient is the inverse
    permutation (`inverse`)."""

    @staticmethod
    def forward(ctx, x, shard, fn, inverse):
        ctx.shard, ctx.inverse = shard, inverse
        return fn(x, shard)

    @staticmethod
    def backward(ctx, g):
        return ctx.inverse(g, ctx.shard), None, None, None


def ulysses_attention(q, k, v, shard: ContextShard, core) -> torch.Tensor:
    """All-to-all context parallelism (module doc): `core` sees heads / cp whole sequences."""
    if k.shape[1] % shard.cp:  # too few kv heads to split: give each query head its own
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q, k, v = (_Permutation.apply(t, shard, _seq_to_heads, _heads_to_seq) for t in (q, k, v))
    return _Permutation.apply(core(q, k, v), shard, _heads_to_seq, _seq_to_heads)
