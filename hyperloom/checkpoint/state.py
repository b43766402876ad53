"""Layout-free model and optimizer state: gather shards to full tensors, slice them back.

The whole format keeps every tensor whole and keyed by parameter name, so it loads into any
layout and into one process: loading slices each tensor for the rank's shard (or experts) and,
under FSDP, distributes it over dp. Optimizer state is keyed by parameter name too, not by
position, which a different layout may change. Gathering costs a full copy per rank; the
sharded format avoids that.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyperloom.models.shard import Shard, shard_of
from hyperloom.parallel.layout import ParallelModel
from hyperloom.parallel.zero1 import ZeroOneAdamW


def _place(full: torch.Tensor, like: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """This rank's piece of `full`, shaped and placed like `like`.

    A shard's piece is copied into contiguous storage of its own: `Shard.piece` is a view into
    `full`, strided when split along a dimension other than 0 (row-parallel weights), and fused
    AdamW walks its state as if it were laid out like the contiguous parameter, so Adam moments
    loaded as such views updated the wrong elements; any view would also keep the whole tensor
    alive on every rank."""
    piece = full
    if shard is not None:
        piece = shard.piece(full).clone(memory_format=torch.contiguous_format)
    if hasattr(like, "device_mesh"):  # DTensor
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(piece.to(like.device), like.device_mesh, like.placements)
    return piece.to(device=like.device, dtype=like.dtype)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    if hasattr(dst, "to_local"):
        dst.to_local().copy_(src.to_local())
    else:
        dst.copy_(src)


def full_model_state(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """Every parameter whole, on CPU (a collective: call on every rank)."""
    return pm.gather_state({name: pm.whole(p, p).cpu() for name, p in pm.state_params()})


@torch.no_grad()
def load_full_model_state(
    pm: ParallelModel, state: dict[str, torch.Tensor], partial: bool = False
) -> list[str]:
    """Slice whole tensors into this rank's parameters; returns the names loaded. `partial`:
    load the names the state and the model share, leave the others as they are (a model
    initialised in part from another's weights)."""
    params = pm.local_params()
    names = {n for n, _ in params}
    missing = names - set(state)
    # A pipeline rank holds a part of the model: the rest of the state is other ranks'.
    unexpected = set() if pm.pipelined else set(state) - names
    if partial:
        params = [(n, p) for n, p in params if n in state]
    elif missing or unexpected:
        raise KeyError(
            f"state does not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    for name, p in params:
        shard = shard_of(p)
        full_shape = list(p.shape) if shard is None else shard.whole_shape(p.shape)
        if list(state[name].shape) != full_shape:
            raise ValueError(
                f"{name}: checkpoint has shape {tuple(state[name].shape)}, model needs "
                f"{tuple(full_shape)}"
            )
        _copy_into(p, _place(state[name], p, shard))
    return [n for n, _ in params]


def _names(pm: ParallelModel) -> dict[int, tuple[str, nn.Parameter]]:
    return {id(p): (n, p) for n, p in pm.local_params()}


def optimizer_params(opt) -> list[nn.Parameter]:
    """The parameters `opt` updates (ZeRO-1 keeps them outside its param groups)."""
    if isinstance(opt, ZeroOneAdamW):
        return opt.params
    return [p for group in opt.param_groups for p in group["params"]]


def per_param_state(opt) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
    """Each parameter's optimizer state, shaped like the parameter (a collective over dp
    under ZeRO-1, whose moments live in one flat buffer)."""
    if isinstance(opt, ZeroOneAdamW):
        return opt.state_by_param()
    return {p: opt.state.get(p, {}) for p in optimizer_params(opt)}


def full_optimizer_state(pm: ParallelModel, opt) -> dict[str, Any]:
    """AdamW state whole and keyed by parameter name (a collective)."""
    by_id = _names(pm)
    reported = {id(p) for _, p in pm.state_params()}
    out: dict[str, Any] = {}
    for p, st in per_param_state(opt).items():
        name, param = by_id[id(p)]
        if id(p) not in reported:  # another copy of this parameter reports it
            continue
        out[name] = {
            k: (pm.whole(v, param).cpu() if v.dim() > 0 else _local(v).cpu()) for k, v in st.items()
        }
    return {"state": pm.gather_state(out)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


@torch.no_grad()
def load_full_optimizer_state(pm: ParallelModel, opt, saved: dict[str, Any]) -> None:
    by_id = _names(pm)
    state = saved["state"]
    if isinstance(opt, ZeroOneAdamW):
        per_param = {}
        for p in opt.params:
            name, param = by_id[id(p)]
            if name not in state:
                raise KeyError(f"optimizer state has no entry for {name}")
            shard = shard_of(param)
            per_param[p] = {
                k: v if v.dim() == 0 else _place(v, p, shard) for k, v in state[name].items()
            }
        opt.load_state_by_param(per_param)
        return
    for group in opt.param_groups:
        for p in group["params"]:
            name, param = by_id[id(p)]
            if name not in state:
                raise KeyError(f"optimizer state has no entry for {name}")
            shard = shard_of(param)
            entry = {}
            for k, v in state[name].items():
                if v.dim() == 0:  # Adam's step counter: on the device for fused kernels
                    on_device = group.get("fused") or group.get("capturable")
                    entry[k] = v.clone().to(p.device) if on_device else v.clone()
                else:
                    entry[k] = _place(v, p, shard)
            opt.state[p] = entry


@torch.no_grad()
def nonfinite_state(pm: ParallelModel, opt) -> list[str]:
    """The names of this rank's parameter and optimizer state tensors that hold a NaN or an
    infinity, which a checkpoint must never be written from. Each rank checks only the pieces
    it holds (the caller all-reduces the verdict). One sum per tensor, read back in one host
    sync: a sum is finite unless an element is not (or the sum overflows, which the exact
    `isfinite` check of that tensor then rules out), and costs a fraction of `isfinite`."""
    params = pm.local_params()
    names = {id(p): n for n, p in params}
    tensors: list[tuple[str, torch.Tensor]] = list(params)
    if isinstance(opt, ZeroOneAdamW):  # this rank's slices of the flat FP32 buffers
        tensors += [(f"optimizer {k} (ZeRO-1 shard)", getattr(opt, k)) for k in _ZERO1_STATE]
    else:
        for p, st in opt.state.items():
            for k, v in st.items():
                if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                    tensors.append((f"{names.get(id(p), '?')} (optimizer {k})", v))
    local = [(n, _local_piece(t)) for n, t in tensors]
    local = [(n, t) for n, t in local if t.numel()]
    if not local:
        return []
    sums = torch.stack([t.sum(dtype=torch.float32) for _, t in local])
    suspects = (~torch.isfinite(sums)).nonzero().flatten().tolist()  # the one host sync
    return [local[i][0] for i in suspects if not bool(torch.isfinite(local[i][1]).all())]


_ZERO1_STATE = ("master", "exp_avg", "exp_avg_sq")


def _local_piece(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t.detach()
