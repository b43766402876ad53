"""Which piece of a whole parameter a rank holds.

Parallel layers replace a parameter by this rank's slice and attach a `Shard`; init, gradient
clipping and checkpoints read it through `shard_of` to draw, reduce or reassemble whole
tensors. A small frozen record rather than DTensor placements: our parallel layers are plain
modules calling their own collectives (with FP8 amax reductions inside), and DTensor
parameters would send every op through DTensor's dispatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

_ATTR = "hyperloom_shard"


@dataclass(frozen=True)
class Shard:
    """Slice `index` of `parts` equal slices along `dim` of the whole tensor, split over the
    mesh dimension `over` ("tp" for tensor-parallel layers, "ep" for routed experts, "etp" for
    the experts' hidden width under expert tensor parallelism).

    `then`: a second split of that slice (over another group), for a tensor split two ways —
    a routed expert weight split over ep (experts) and then over etp (hidden width). The
    whole tensor is gathered over `then`'s group first, then over this one's."""

    dim: int
    index: int
    parts: int
    over: str = "tp"
    then: Shard | None = None

    def whole_shape(self, shape: torch.Size | list[int]) -> list[int]:
        """The whole tensor's shape from this slice's."""
        out = list(shape) if self.then is None else self.then.whole_shape(shape)
        out[self.dim] *= self.parts
        return out

    def piece(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole tensor (a view)."""
        piece = whole.chunk(self.parts, dim=self.dim)[self.index]
        return piece if self.then is None else self.then.piece(piece)

    def chain(self) -> list[Shard]:
        """The splits outermost first (this one, then `then`'s, ...)."""
        return [self] + ([] if self.then is None else self.then.chain())

    def splits(self, over: str) -> bool:
        """Whether one of the splits runs over the mesh dimension `over`."""
        return any(s.over == over for s in self.chain())

    def gather_order(self) -> list[Shard]:
        """The splits innermost first: the order a whole tensor is gathered in."""
        return self.chain()[::-1]


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


def whole_sequence(model) -> Callable[[str], bool]:
    """Whether a module path lies in (or is) one of the model's `whole_sequence_modules`:
    submodules that run on whole sequences under sequence and context parallelism
    (DeepSeek's MTP; a vision-language model's embedding, encoder and projector)."""
    names = tuple(getattr(model, "whole_sequence_modules", ()))
    return lambda path: any(path == n or path.startswith(f"{n}.") for n in names)
