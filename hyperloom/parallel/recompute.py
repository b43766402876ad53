"""The recompute slot: activation checkpointing applied from outside the model, by policy.

`train.recompute` names what each transformer block keeps for its backward:

- "full": the block's input only; the backward runs the block's forward again
  (`torch.utils.checkpoint`, non-reentrant), as Megatron's full recompute;
- a list of modules, the family's recompute plan saying where each one is in a block:
  "core_attn" checkpoints the attention core (softmax(QKᵀ)V; with flash attention only its
  log-sum-exp goes; Korthikanti et al., arXiv 2205.05198 §5), "mlp_act" and "norm" drop an
  output that the next module has stored for its own backward (the SwiGLU activation the
  down projection multiplies, a norm's output the block's input projections multiply) once
  that module has run, and compute it again just before that module's backward needs it,
  from inputs that are stored anyway -- Megatron's "output-discarding checkpoint";
- "selective" is core_attn + mlp_act: the cheap, memory-heavy pieces;
- DeepSeek's "experts" (the routed experts' bank) and "mla_up" (MLA's up-projections, query
  RoPE and attention core) are regions checkpointed whole.

`train.recompute_layers` limits it to the first N blocks of each model chunk.

A recomputed forward must not move state twice: delayed FP8 scaling replays the scales of
the first pass and records no amax, an MoE router counts its expert loads once
(`engine.recompute`). Dropout draws the same masks (the checkpoint restores the RNG). It runs
under the torch-function modes the first pass ran under (the pipeline's split backward routes
linears through one), so that it stores what the first pass stored.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

from hyperloom.config import recompute_policy
from hyperloom.engine.recompute import Replay


def apply_recompute(
    model: nn.Module, policy: str, layers: int, plan: dict[str, Any], *, partial: bool = False
) -> int:
    """Apply `policy` to the first `layers` blocks (0 = all) of `model` or of a pipeline chunk
    (`partial`: it may hold no block); returns how many blocks recompute."""
    full, modules = recompute_policy(policy)
    if not full and not modules:
        return 0
    blocks = [m for _, m in sorted(model.layers.items(), key=lambda kv: int(kv[0]))]
    if not blocks and not partial:
        raise ValueError("train.recompute needs a model with transformer blocks (layers)")
    blocks = blocks[:layers] if layers else blocks
    for block in blocks:
        if full:
            _checkpoint_forward(block)
            continue
        for module in sorted(modules):
            for entry in plan.get(module, ()):
                if isinstance(entry, str):  # a region checkpointed whole
                    target = _find(block, entry)
                    if target is not None:
                        _checkpoint_forward(target)
                else:  # (producer, consumer): the producer's output is dropped and rebuilt
                    producer, consumer = (_find(block, path) for path in entry)
                    if producer is not None and consumer is not None:
                        _drop_output_after(producer, consumer)
    return len(blocks)


def _find(block: nn.Module, path: str) -> nn.Module | None:
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None  # e.g. a MoE block has no dense MLP activation


def _recomputes(module: nn.Module) -> bool:
    """Only a training forward that builds a graph recomputes (not evaluation, not a cached
    decode)."""
    return module.training and torch.is_grad_enabled()


_inside = threading.local()  # how many checkpointed regions this thread is running


def _checkpoint_forward(module: nn.Module) -> None:
    """The module's forward becomes a checkpointed region; its parameters keep their names.
    A region run inside another (mla_up holds the attention core) runs plainly: the outer
    one recomputes it once."""
    forward = module.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not _recomputes(module) or getattr(_inside, "depth", 0):
            return forward(*args, **kwargs)
        replay = Replay()
        modes = _get_current_function_mode_stack()  # e.g. a pipeline's split backward

        def region(*a, **k):
            with replay.run(), contextlib.ExitStack() as stack:
                if replay.replaying:  # the recompute runs in the backward, outside them
                    for mode in modes:
                        stack.enter_context(mode)
                _inside.depth = getattr(_inside, "depth", 0) + 1
                try:
                    return forward(*a, **k)
                finally:
                    _inside.depth -= 1

        return checkpoint(region, *args, use_reentrant=False, **kwargs)

    module.forward = run


class _Held:
    """One forward's producer output, dropped and put back: the producer keeps its own graph
    (what it stores for its backward stays), only this output's storage goes."""

    def __init__(self, fn, args: tuple, kwargs: dict, output: torch.Tensor):
        self.fn, self.args, self.kwargs, self.output = fn, args, kwargs, output

    def drop(self) -> bool:
        """Free the output's storage, unless it shares it with another tensor (a view of a
        larger buffer: freeing it would take the other tensor along)."""
        out = self.output
        if (
            out.storage_offset()
            or out.untyped_storage().nbytes() != out.numel() * out.element_size()
        ):
            return False
        out.untyped_storage().resize_(0)
        return True

    @torch.no_grad()
    def restore(self, _grad=None) -> None:
        """Before the consumer's backward: the producer's forward again, from its inputs,
        its values back in the dropped storage (grad mode on inside, so that the kernels are
        the ones the first pass ran)."""
        if self.output.untyped_storage().size() > 0:
            return
        with torch.enable_grad():
            out = self.fn(*self.args, **self.kwargs)
        first = (out[0] if isinstance(out, tuple) else out).detach()
        storage = self.output.untyped_storage()
        storage.resize_(first.untyped_storage().size())
        storage.copy_(first.untyped_storage())
        self.args = self.kwargs = None


def _drop_output_after(producer: nn.Module, consumer: nn.Module) -> None:
    """The producer's (first) output is freed once the consumer's forward has run, and its
    values are put back when the gradient of the consumer's output arrives, before the
    consumer's backward reads what it stored. The producer's inputs are stored anyway (its
    own backward needs them), so keeping them costs nothing."""
    forward = producer.forward
    pending: list[_Held] = []

    @functools.wraps(forward)
    def produce(*args, **kwargs):
        out = forward(*args, **kwargs)
        if _recomputes(producer):
            first = out[0] if isinstance(out, tuple) else out
            pending.append(_Held(forward, args, kwargs, first))
        return out

    def consumed(_module, _args, output):
        if not pending:
            return output
        held = pending.pop()
        outs = output if isinstance(output, tuple) else (output,)
        grad_outputs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if grad_outputs and held.drop():  # something will backpropagate through it
            grad_outputs[0].register_hook(held.restore)
        return output

    producer.forward = produce
    consumer.register_forward_hook(consumed)
