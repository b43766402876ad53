"""Which piece of a whole parameter a rank holds.

Parallel layers (tensor parallel, expert parallel) replace a parameter by this rank's slice
and attach a `Shard` to it. Everyone else reads it through `shard_of`: a model's
initialisation draws the whole tensor and keeps its slice, so every layout starts from the
single-device weights; gradient clipping sums a sharded parameter's squares over its group;
checkpoints reassemble whole tensors so a checkpoint is independent of the layout.

Why not DTensor placements: our tensor-parallel layers are plain modules holding plain
tensors and calling their own collectives (Megatron's column/row-parallel pattern, with the
FP8 amax reductions inside them); DTensor parameters would send every op through DTensor's
dispatch. A small frozen record, carried across re-allocation by name, says what
initialisation, clipping and checkpoints need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

_ATTR = "hyperloom_shard"


@dataclass(frozen=True)
class Shard:
    """Slice `index` of `parts` equal slices along `dim` of the whole tensor, split over the
    mesh dimension `over` ("tp" for tensor-parallel layers, "ep" for routed experts)."""

    dim: int
    index: int
    parts: int
    over: str = "tp"

    def whole_shape(self, shape: torch.Size | list[int]) -> list[int]:
        """The whole tensor's shape from this slice's."""
        out = list(shape)
        out[self.dim] *= self.parts
        return out

    def piece(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole tensor (a view)."""
        return whole.chunk(self.parts, dim=self.dim)[self.index]


def shard_of(p: torch.Tensor) -> Shard | None:
    """The `Shard` a parallel layer attached to `p`, or None for a whole parameter."""
    return getattr(p, _ATTR, None)


def set_shard(p: torch.Tensor, shard: Shard) -> None:
    setattr(p, _ATTR, shard)


def shards_by_name(model: nn.Module) -> dict[str, Shard]:
    """Parameter name -> `Shard` for the model's sharded parameters. `to_empty` and FSDP2
    make new Parameter objects; `restore_shards` puts the records back by name."""
    return {n: s for n, p in model.named_parameters() if (s := shard_of(p)) is not None}


def restore_shards(model: nn.Module, shards: dict[str, Shard]) -> None:
    for name, shard in shards.items():
        set_shard(model.get_parameter(name), shard)
