"""Delayed FP8 scaling that updates once per optimizer step (`precision.fp8_delayed_update =
"step"`, `DelayedScaling(update="step")`): every quantization of a step uses the scale of the
step's start, the step's amaxes merge by max into the current slot, and `end_fp8_step` moves
the scale and rolls the window once. So the order of the micro-batches changes nothing, a
recompute or an eval forward changes nothing, and the default "microbatch" recipe keeps
moving its scales before every quantization."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyperloom.config import ConfigError, load_config
from hyperloom.engine.fp8 import (
    E4M3,
    E5M2,
    DelayedScaling,
    Fp8Linear,
    end_fp8_step,
    recipe_from_name,
)
from hyperloom.engine.recompute import Replay
from hyperloom.models.experts import Experts

STEP = DelayedScaling(amax_history_len=4, update="step")
LEN = STEP.amax_history_len


def layer(recipe: DelayedScaling = STEP, seed: int = 0) -> Fp8Linear:
    torch.manual_seed(seed)
    lin = Fp8Linear.from_linear(nn.Linear(32, 16), recipe)
    lin.reset_fp8_state()
    return lin


def micro_batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output gradient) pairs of growing size, so each raises the step's amaxes."""
    g = torch.Generator().manual_seed(1)
    return [
        ((i + 1) * torch.randn(8, 32, generator=g), (i + 2) * torch.randn(8, 16, generator=g))
        for i in range(n)
    ]


def run(lin: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """One micro-batch's forward and backward; returns the output."""
    x = x.clone().requires_grad_()
    y = lin(x)
    y.backward(dy)
    return y.detach()


def te_scales(amax: torch.Tensor) -> torch.Tensor:
    """fp8_max / amax of the (input, weight, grad_output) columns (hybrid: E5M2 gradients)."""
    maxes = (E4M3.max, E4M3.max, E5M2.max) * (amax.shape[-1] // 3)
    return torch.stack([m / a for m, a in zip(maxes, amax.unbind(-1), strict=True)], -1)


def state(lin: nn.Module) -> list[torch.Tensor]:
    return [lin.fp8_amax_history.clone(), lin.fp8_scale.clone()]


def test_the_scale_holds_through_the_step_and_moves_once_at_its_end():
    lin, mbs = layer(), micro_batches()
    for step in range(2):
        start = lin.fp8_scale.clone()
        for x, dy in mbs:
            run(lin, x, dy)
            assert torch.equal(lin.fp8_scale, start)  # no micro-batch moves it
        # One slot holds the step's max per column (input, weight, grad_output).
        want = torch.stack(
            [
                max(x.abs().max() for x, _ in mbs),
                lin.weight.detach().abs().max(),
                max(dy.abs().max() for _, dy in mbs),
            ]
        )
        assert torch.equal(lin.fp8_amax_history[0], want)
        assert step or not lin.fp8_amax_history[1:].any()  # nothing rolled during step 1
        end_fp8_step(lin)
        # TE's update: scale from the window's max, then the window rolls by -1.
        assert torch.equal(lin.fp8_scale, te_scales(lin.fp8_amax_history.amax(0)))
        assert torch.equal(lin.fp8_amax_history[LEN - 1], want)
        assert not lin.fp8_amax_history[0].any()
    assert int((lin.fp8_amax_history > 0).sum()) == 2 * 3  # two steps, two rows filled


def test_the_order_of_the_micro_batches_changes_nothing():
    """Each micro-batch's output is bitwise the same in any order, and so is the state."""
    mbs = micro_batches(4)
    fwd, rev = layer(), layer()
    for _ in range(2):
        ys = [run(fwd, x, dy) for x, dy in mbs]
        ys_rev = [run(rev, x, dy) for x, dy in reversed(mbs)][::-1]
        assert all(torch.equal(a, b) for a, b in zip(ys, ys_rev, strict=True))
        end_fp8_step(fwd)
        end_fp8_step(rev)
        assert all(torch.equal(a, b) for a, b in zip(state(fwd), state(rev), strict=True))
    assert fwd.fp8_scale.ne(1).all()  # the scales did move: the test can see a difference


def test_microbatch_mode_moves_before_every_quantization():
    """The default: each micro-batch's scale comes from the amaxes before it, so the order
    of the micro-batches changes the outputs; `end_fp8_step` leaves it alone."""
    recipe = DelayedScaling(amax_history_len=4)
    assert recipe.update == "microbatch"
    mbs = micro_batches(3)
    fwd, rev = layer(recipe), layer(recipe)
    ys = [run(fwd, x, dy) for x, dy in mbs]
    ys_rev = [run(rev, x, dy) for x, dy in reversed(mbs)][::-1]
    assert not torch.equal(ys[1], ys_rev[1])
    # Three quantizations of the weight: three filled slots, the last at 0 (TE's layout),
    # and the scale from the two before it.
    w = fwd.weight.detach().abs().max()
    assert torch.equal(fwd.fp8_amax_history[:, 1], torch.stack([w, 0 * w, w, w]))
    assert torch.equal(fwd.fp8_scale[1], E4M3.max / w)
    before = state(fwd)
    end_fp8_step(fwd)
    assert all(torch.equal(a, b) for a, b in zip(before, state(fwd), strict=True))


def test_one_micro_batch_per_step_scales_as_microbatch_mode():
    """With one micro-batch a step, each quantization sees the same window either way (the
    roll merely comes at the step's end instead of before the next quantization): the same
    outputs and gradients, bit for bit, step after step."""
    mbs = micro_batches(4)
    step, micro = layer(), layer(DelayedScaling(amax_history_len=4))
    for x, dy in mbs:
        assert torch.equal(run(step, x, dy), run(micro, x, dy))
        assert torch.equal(step.weight.grad, micro.weight.grad)
        assert torch.equal(step.fp8_scale, micro.fp8_scale)  # the scales this step used
        end_fp8_step(step)
        end_fp8_step(micro)  # a no-op for "microbatch"
    assert micro.fp8_scale.ne(1).all()  # they moved: the comparison can fail


def region(x: torch.Tensor, replay: Replay, lin: nn.Module) -> torch.Tensor:
    """A checkpointed region as `train.recompute` makes it: its first pass records the
    scales, the recompute in the backward replays them."""
    with replay.run():
        return lin(x)


def test_a_recompute_reuses_the_scale_and_records_nothing():
    mbs = micro_batches(2)
    plain, ckpt = layer(), layer()
    for _ in range(2):
        for x, dy in mbs:
            y = run(plain, x, dy)
            replay = Replay()
            xr = x.clone().requires_grad_()
            out = checkpoint(region, xr, replay, ckpt, use_reentrant=False)
            out.backward(dy)
            assert replay.passes == 2  # the forward ran again in the backward
            assert torch.equal(out.detach(), y)
            assert torch.equal(ckpt.weight.grad, plain.weight.grad)
        end_fp8_step(plain)
        end_fp8_step(ckpt)
        assert all(torch.equal(a, b) for a, b in zip(state(plain), state(ckpt), strict=True))


def test_eval_reads_the_step_scale_and_changes_nothing():
    lin, (x, dy) = layer(), micro_batches(1)[0]
    run(lin, x, dy)
    end_fp8_step(lin)  # a scale that is not 1
    before = state(lin)
    lin.eval()
    with torch.no_grad():
        y_eval = lin(5 * x)
    assert all(torch.equal(a, b) for a, b in zip(before, state(lin), strict=True))
    lin.train()
    assert torch.equal(lin(5 * x).detach(), y_eval)  # training quantizes with that scale


def test_an_empty_expert_keeps_the_step_max_of_its_busy_micro_batches():
    """An MoE bank's per-expert histories (experts, len, 9): an idle expert records amax 0
    (`observe_empty`), which under "step" merges into the step's slot, so a micro-batch
    without tokens does not erase one with tokens; the roll moves every expert's window once
    (the same window as its busy neighbour's)."""
    torch.manual_seed(0)
    bank = Experts(2, 32, 16)
    for w in (bank.w1, bank.w3, bank.w2):
        nn.init.normal_(w, std=0.1)
    bank.enable_fp8(STEP)
    bank.reset_fp8_state()
    x = torch.randn(6, 32)
    for counts in ([3, 3], [6, 0]):  # expert 1 busy, then idle
        bank(x, torch.tensor(counts)).sum().backward()
    busy, hist = x[3:].abs().max(), bank.fp8_amax_history  # (experts, len, 9)
    assert torch.equal(hist[1, 0, 0], busy)  # w1's input column of expert 1
    assert hist[:, 0].all() and not hist[:, 1:].any()  # every column seen, nothing rolled
    assert torch.equal(bank.fp8_scale, torch.ones(2, 9))
    end_fp8_step(bank)
    assert torch.equal(bank.fp8_scale[:, 0], E4M3.max / torch.stack([x.abs().max(), busy]))
    assert torch.equal(bank.fp8_scale, te_scales(hist[:, LEN - 1]))
    assert not hist[:, 0].any() and hist[:, LEN - 1].all()


def test_step_is_for_the_delayed_recipe_only(tmp_path):
    assert recipe_from_name("delayed", delayed_update="step").update == "step"
    with pytest.raises(ValueError, match="delayed recipe only"):
        recipe_from_name("current", delayed_update="step")
    with pytest.raises(ValueError, match="not one of"):
        DelayedScaling(update="sometimes")
    args = ["--precision.fp8", "current", "--precision.fp8_delayed_update", "step"]
    with pytest.raises(ConfigError, match="applies to precision.fp8 = 'delayed' only"):
        load_config(None, args)
    for fp8 in ("delayed", "none"):  # FP8 off: nothing to apply it to, nothing wrong
        args = ["--precision.fp8", fp8, "--precision.fp8_delayed_update", "step"]
        assert load_config(None, args).precision.fp8_delayed_update == "step"
