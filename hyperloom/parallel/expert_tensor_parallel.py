"""Expert tensor parallelism (`parallel.etp`): each routed expert's SwiGLU split over a group
of ranks, with a degree of its own (Megatron-Core's MoE "parallel folding", arXiv 2504.14960).

The etp group is a run of `etp` consecutive ranks inside a tp group (`ParallelMesh.group
("etp")`). Every expert bank (`models.experts.Experts`, after expert parallelism kept this
rank's E / ep experts) keeps 1/etp of each expert's hidden width: w1 and w3 (E, hidden, dim)
column-parallel, split along hidden, and w2 (E, dim, hidden) row-parallel. The rows enter
through an identity whose backward sums their gradient over etp, and the partial outputs
are summed over etp (identity backward): Megatron's column/row pair around the bank, set as
the bank's `hidden_split`. Without sequence parallelism every tp rank routes the same tokens,
so ranks of a tp group in different etp groups hold the same slices and compute the same
results: nothing is reduced between them, and a weight's gradient is its one-process slice.

Expert weights carry `Shard(1 or 2, etp_rank, etp, over="etp")`, nested under the expert-
parallel `Shard(0, ..., over="ep")` when ep > 1 (`Shard.then`), so checkpoints, init and the
gradient norm see the whole tensors. Under sequence parallelism the ranks' rows differ:
`ExpertTensorSplit` gathers and reduce-scatters them over the etp group. With etp = tp a
slice's gradient, made from the whole tp group's rows, is not summed over tp again
(`parallelize` takes the split weights out of the sequence-parallel partial-gradient sums);
with etp < tp the tp / etp ranks holding the same slice (one per etp group, the mesh's
"etp_replica" group) each made it from their own group's rows, and `finish_grads` sums it
over them. FSDP2 shards a bank's slices like any parameter, over the expert-data-parallel
group under ep; sharded checkpoints record an ep-then-etp slice on the 2-D (ep, etp) mesh.

FP8 expert GEMMs quantize each slice with the whole tensor's scales: the bank hands the
engine `ExpertTensorSplit.reduce_max` (an all-reduce MAX over etp) for its sliced operands
(`models.experts`), as the dense tensor-parallel linears do; block recipes need slices of
whole blocks (`check_fp8_blocks`). Under the overlapped ep lanes (`parallel.ep_overlap`)
the etp collectives run synchronously inside a lane. That is safe: lanes switch only where
one waits for an all-to-all it started (`overlap.Duet`), so which lane runs when is fixed by
the program, identical on every rank of a tp group, and each etp group meets its
collectives in the same order on all its ranks; the all-to-alls stay hidden
(tests/distributed/test_etp_compose.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from hyperloom.engine.fp8.recipes import BlockwiseScaling, MXFP8Scaling
from hyperloom.models.experts import Experts
from hyperloom.models.shard import Shard, set_shard, shard_of, whole_sequence
from hyperloom.parallel import tensor_parallel as tpl
from hyperloom.parallel.expert_parallel import gather_rows, scatter_rows

# parameter -> the dimension its hidden width runs along: w1, w3 (E, hidden, dim), w2 (E, dim,
# hidden)
HIDDEN_DIM = {"w1": 1, "w3": 1, "w2": 2}


class ExpertTensorSplit:
    """A bank's `hidden_split` (see `models.experts`): the column/row pair over the etp group.

    `sequence`: the bank's rows differ between the etp ranks (sequence parallelism, etp =
    tp: each rank routed its own slice of the sequence). Then `enter` all-gathers the group's
    rows (padded to the longest rank's) and regroups them by expert, and `leave` scatters the
    partial outputs back into the gathered layout and reduce-scatters them, so each rank gets
    its own rows summed over the group (Megatron's sequence-parallel expert tensor
    parallelism); the gather's backward sums the rows' gradient over etp, the
    reduce-scatter's gathers the outputs' gradient."""

    def __init__(self, group, rank: int, size: int, sequence: bool = False):
        self.group, self.rank, self.size, self.sequence = group, rank, size, sequence

    def enter(self, x: torch.Tensor, counts: torch.Tensor):
        """Rows in (x (N, dim), counts[e] rows per local expert) -> (rows, counts, undo) for
        the bank's GEMMs; `undo` is what `leave` needs."""
        if not self.sequence:  # identity; backward sums the rows' gradient over etp ("f")
            return tpl.copy_to_tp(x, self.group), counts, None
        return gather_rows(x, counts, self.group, (0, counts.shape[0]))

    def leave(self, out: torch.Tensor, undo) -> torch.Tensor:
        """Partial outputs -> this rank's rows' outputs summed over etp."""
        if undo is None:  # summed over etp; backward the identity ("g")
            return tpl.reduce_from_tp(out, self.group)
        return scatter_rows(out, undo, self.group)

    def reduce_max(self, amax: torch.Tensor) -> torch.Tensor:
        """An FP8 amax of this rank's slice -> its maximum over the group: the whole
        tensor's (`models.experts`: the bank passes it for the sliced operands)."""
        return tpl._all_reduce_op(amax, self.group, dist.ReduceOp.MAX)


def check_fp8_blocks(bank: Experts, path: str, etp: int) -> None:
    """Block recipes on an etp slice: each scale block must lie inside one slice of the
    hidden width (1 x 128 / 128 x 128 blockwise, 1 x 32 MXFP8), or a block would straddle
    ranks and its scale differ from one process's."""
    recipe = bank.recipe
    if not isinstance(recipe, (BlockwiseScaling, MXFP8Scaling)):
        return
    width = bank.w1.shape[1] // etp
    if width % recipe.block:
        raise ValueError(
            f"{path}: FP8 {recipe.name} on an etp slice of {width} hidden features (hidden "
            f"width {bank.w1.shape[1]} / etp {etp}), not a multiple of the {recipe.block}-"
            f"element scale block; make the hidden width a multiple of etp * {recipe.block}"
        )


def apply_expert_tensor_parallel(
    model: nn.Module,
    group,
    etp_rank: int,
    etp: int,
    partial: bool = False,
    sequence_parallel: bool = False,
) -> list[str]:
    """Keep 1/etp of every expert bank's hidden width on this rank (model on meta); returns
    the names of the split parameters. `partial`: the model is a pipeline chunk, which may
    hold no MoE layer. `sequence_parallel`: the banks route each rank's own sequence slice
    (etp = tp), except those under the model's `whole_sequence_modules` (DeepSeek's MTP),
    whose rows every tp rank holds alike."""
    names = []
    whole = whole_sequence(model)
    banks = [(path, m) for path, m in model.named_modules() if isinstance(m, Experts)]
    for path, bank in banks:
        check_fp8_blocks(bank, path, etp)
        for name, dim in HIDDEN_DIM.items():
            old = getattr(bank, name)
            if old.shape[dim] % etp:
                raise ValueError(
                    f"{path}.{name}: hidden width {old.shape[dim]} does not split over "
                    f"etp = {etp} ranks"
                )
            shape = list(old.shape)
            shape[dim] //= etp
            new = nn.Parameter(
                torch.empty(shape, dtype=old.dtype, device=old.device),
                requires_grad=old.requires_grad,
            )
            mine = Shard(dim, etp_rank, etp, over="etp")
            outer = shard_of(old)  # the expert-parallel split, if any: experts first
            set_shard(new, mine if outer is None else replace(outer, then=mine))
            setattr(bank, name, new)
            names.append(f"{path}.{name}" if path else name)
        sliced = sequence_parallel and not whole(path)
        bank.hidden_split = ExpertTensorSplit(group, etp_rank, etp, sequence=sliced)
    if not banks and not partial:
        raise ValueError("parallel.etp > 1 needs a Mixture-of-Experts model (no MoE layer found)")
    return names
