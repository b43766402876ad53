"""Frozen parameters: the parts of a model a training stage leaves alone.

`train.freeze` lists parts by name -- a vision-language model's "vision", "projector" and
"decoder" (everything else: embedding, blocks, norm, head) -- or glob patterns over
parameter names ("layers.0.*"). A frozen parameter has `requires_grad = False` from the
start, so autograd computes no gradient for it, data parallelism reduces none, the
optimizer holds no state for it and ZeRO / FSDP leave it whole; a checkpoint still saves
its weights. Parameters no forward reaches (`model.unused_parameters()`, a vision encoder's
blocks above its feature layer) are frozen always: nothing could train them, and data
parallelism would wait for their gradients.

LLaVA's two stages are then `train.freeze = ["vision", "decoder"]` (projector alignment) and
`train.freeze = ["vision"]` (instruction tuning of projector and decoder).
"""

from __future__ import annotations

import fnmatch

from torch import nn

PARTS = ("vision", "projector", "decoder")


def _in_part(name: str, part: str) -> bool:
    if part == "decoder":
        return not name.startswith(("vision.", "projector."))
    return name.startswith(f"{part}.")


def frozen_names(model: nn.Module, freeze: list[str] | tuple[str, ...]) -> set[str]:
    """Names of the parameters `freeze` names (parts or patterns), plus the unused ones."""
    names = [n for n, _ in model.named_parameters()]
    unused = getattr(model, "unused_parameters", None)
    out = set(unused()) if unused is not None else set()
    for entry in freeze:
        if entry in PARTS:
            out.update(n for n in names if _in_part(n, entry))
        else:
            out.update(n for n in names if fnmatch.fnmatchcase(n, entry))
    return out


def freeze_problems(model: nn.Module, freeze: list[str] | tuple[str, ...]) -> list[str]:
    """What is wrong with `train.freeze` for this (whole) model: an entry matching no
    parameter, or nothing left to train."""
    names = [n for n, _ in model.named_parameters()]
    problems = []
    for entry in freeze:
        if entry in PARTS:
            if not any(_in_part(n, entry) for n in names):
                problems.append(
                    f"train.freeze names '{entry}', which this model does not have "
                    f"(parts: vision, projector and decoder in a model.family = 'vlm')"
                )
        elif not any(fnmatch.fnmatchcase(n, entry) for n in names):
            problems.append(
                f"train.freeze pattern '{entry}' matches no parameter (names look like "
                f"{', '.join(names[:3])}); use a part ({', '.join(PARTS)}) or a glob"
            )
    if not problems and len(frozen_names(model, freeze)) == len(names):
        problems.append(f"train.freeze = {list(freeze)} freezes every parameter: nothing trains")
    return problems


def apply_freeze(model: nn.Module, freeze: list[str] | tuple[str, ...]) -> list[str]:
    """Set requires_grad = False on the frozen parameters of `model` (a whole model or a
    pipeline chunk, on any device); returns their names."""
    names = frozen_names(model, freeze)
    for n, p in model.named_parameters():
        if n in names:
            p.requires_grad_(False)
    return sorted(names)
