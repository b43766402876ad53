"""Swap a model's `nn.Linear` layers and MoE experts for FP8 ones, except those kept in high
precision.

`precision.fp8_keep` holds fnmatch patterns over module paths that stay in BF16/FP32. The
defaults follow DeepSeek-V3 §3.3.1 and TransformerEngine practice: embeddings, the output
head, MoE routers/gates and norms are cheap and numerically sensitive; the attention core is
no `nn.Linear` and never converts. Megatron's `--first-last-layers-bf16` becomes `layers.N.*`
keep patterns (`hyperloom.parallel.apply_fp8`). Stacked experts switch to the FP8 grouped
linear. Conversion runs on the meta-device model before parallelization and reuses each
layer's Parameters, so parameter names do not change. The attention q/k projections stay FP8
by default, as in DeepSeek-V3; keeping them in BF16 helps a model whose attention logits have
grown large (docs/fp8.md).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable

import torch
from torch import nn

from hyperloom.engine.fp8.modules import Fp8Linear, Fp8State
from hyperloom.engine.fp8.recipes import Recipe

log = logging.getLogger("hyperloom.engine.fp8")

DEFAULT_KEEP = ("tok_embeddings", "*embed*", "output", "lm_head", "*router*", "*.gate", "*norm*")


def keeps(name: str, keep: Iterable[str]) -> bool:
    """Whether module path `name` matches one of the keep patterns (full path or leaf)."""
    leaf = name.rpartition(".")[2]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(leaf, p) for p in keep)


def convert_to_fp8(
    model: nn.Module,
    recipe: Recipe,
    keep: Iterable[str] = DEFAULT_KEEP,
    fp8_activation: bool = False,
) -> list[str]:
    """Replace every plain `nn.Linear` whose path matches no `keep` pattern by an
    `Fp8Linear` using `recipe`, in place, and switch modules that run their own GEMMs
    (an `enable_fp8(recipe, fp8_activation)` method, e.g. MoE experts) to FP8. Returns the
    converted module paths."""
    keep = tuple(keep)
    converted: list[str] = []
    for name, module in list(model.named_modules()):
        enable = getattr(module, "enable_fp8", None)  # e.g. MoE experts: a grouped linear
        if enable is not None and not keeps(name, keep):
            if enable(recipe, fp8_activation):
                converted.append(name)
            else:
                log.info(
                    "FP8 (%s): %s declines the recipe, stays high precision", recipe.name, name
                )
            continue
        if type(module) is not nn.Linear or keeps(name, keep):
            continue
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, Fp8Linear.from_linear(module, recipe, fp8_activation))
        converted.append(name)
    if not converted:
        log.warning("convert_to_fp8: no nn.Linear left to convert (keep = %s)", list(keep))
    log.info("FP8 (%s): %d linear layers converted", recipe.name, len(converted))
    return converted


def fp8_modules(model: nn.Module) -> Iterable[tuple[str, Fp8State]]:
    """FP8 layers: Fp8Linear, Fp8GroupedLinear and layers built on `Fp8State` with a recipe
    (tensor-parallel linears converted from Fp8Linear)."""
    for name, m in model.named_modules():
        if isinstance(m, Fp8State) and getattr(m, "recipe", None) is not None:
            yield name, m


def reset_fp8_state(model: nn.Module) -> None:
    """Empty amax histories and unit scales everywhere (after `to_empty`)."""
    for _, m in fp8_modules(model):
        m.reset_fp8_state()


def end_fp8_step(model: nn.Module) -> None:
    """Delayed scaling with `update="step"`: the optimizer step's one scale update, on every
    FP8 layer (`Fp8State.end_fp8_step`); a no-op for other recipes. The trainer calls it
    after the step's micro-batches and reductions of the scaling state."""
    for _, m in fp8_modules(model):
        m.end_fp8_step()


def _scaling_buffers(model: nn.Module) -> Iterable[tuple[str, Fp8State, torch.Tensor]]:
    """(full name, module, buffer) of every delayed-scaling buffer; no communication."""
    for name, m in fp8_modules(model):
        if m.fp8_amax_history is not None:
            for leaf in ("fp8_amax_history", "fp8_scale"):
                yield f"{name}.{leaf}", m, getattr(m, leaf)


def fp8_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's delayed-scaling buffers by full name, as they are (no gathering: under ep an
    expert layer's are this rank's piece)."""
    return {key: buf for key, _, buf in _scaling_buffers(model)}


def fp8_state_keys(model: nn.Module) -> list[str]:
    """The names `fp8_state_dict` returns, without gathering anything."""
    return [key for key, _, _ in _scaling_buffers(model)]


def fp8_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The delayed-scaling buffers of every FP8 module, by full name, whole, on CPU. An
    expert-parallel layer's per-expert buffers are gathered over its ep group into the
    (experts, ...) tensors one process holds, so under ep this is a collective: call it
    on every rank."""
    return {key: m.fp8_whole(buf).detach().cpu().clone() for key, m, buf in _scaling_buffers(model)}


@torch.no_grad()
def load_fp8_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore what `fp8_state_dict` saved, whatever ep wrote it (each layer takes its
    piece); the keys must match exactly."""
    mine = {key: (m, buf) for key, m, buf in _scaling_buffers(model)}
    if set(mine) != set(state):
        missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        raise KeyError(
            f"FP8 scaling state does not match: missing {missing[:4]}, extra {extra[:4]}"
        )
    for key, value in state.items():
        m, buf = mine[key]
        piece = m.fp8_piece(value)
        if buf.shape != piece.shape:
            raise ValueError(
                f"{key}: saved shape {tuple(value.shape)} does not fit {tuple(buf.shape)} "
                f"(was the amax history length changed?)"
            )
        buf.copy_(piece)
