"""Single-process pieces of the pipeline runtime: split backward, layer split, chunks,
forward-only schedules and the pipeline config checks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hyperloom.config import ConfigError, load_config
from hyperloom.models.registry import build_model, family
from hyperloom.pipeline import add_communication, build_schedule
from hyperloom.pipeline.runtime import layer_ranges
from hyperloom.pipeline.schedules import forward_only
from hyperloom.pipeline.split_backward import DeferWeightGrads, WeightGradStore


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def test_split_backward_defers_linear_weight_grads_and_adds_up_to_full_backward():
    full, split = _net(), _net()
    x = torch.randn(3, 5, 8)
    full(x).square().sum().backward()
    store = WeightGradStore()
    xs = x.clone().requires_grad_()
    with DeferWeightGrads(store):
        y = split(xs)
    with store.collect(("s", 0)):
        y.square().sum().backward()
    # B: the input gradient and the non-linear parameters are done, linear weights are not.
    assert xs.grad is not None
    assert split[0].weight.grad is None and split[3].weight.grad is None
    assert split[2].weight.grad is not None
    assert store.pending() == [("s", 0)]
    assert store.flush(("s", 0)) == 2  # W: one queued product per linear layer
    for (name, a), b in zip(full.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)
        assert not b.grad.requires_grad


def test_split_backward_outside_collect_is_a_plain_backward():
    full, split = _net(), _net()
    x = torch.randn(4, 8)
    full(x).sum().backward()
    with DeferWeightGrads(WeightGradStore()):
        out = split(x)
    out.sum().backward()
    for a, b in zip(full.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)


def test_split_backward_under_bf16_autocast_matches_autocast_linear():
    full, split = _net(), _net()
    x = torch.randn(6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = full(x)
    ref.float().sum().backward()
    store = WeightGradStore()
    with DeferWeightGrads(store), torch.autocast("cpu", dtype=torch.bfloat16):
        out = split(x)
    assert out.dtype == ref.dtype
    with store.collect("k"):
        out.float().sum().backward()
    store.flush("k")
    for a, b in zip(full.parameters(), split.parameters(), strict=True):
        assert b.grad.dtype == a.grad.dtype == torch.float32
        torch.testing.assert_close(b.grad, a.grad, rtol=2e-2, atol=1e-2)


def test_collect_refuses_nesting():
    store = WeightGradStore()
    with store.collect("a"), pytest.raises(RuntimeError, match="already collecting"):
        with store.collect("b"):
            pass


@pytest.mark.parametrize(
    "n,chunks,counts,want",
    [
        (8, 4, (), [2, 2, 2, 2]),
        (10, 4, (), [3, 3, 2, 2]),
        (6, 4, (0, 3, 3, 0), [0, 3, 3, 0]),
    ],
)
def test_layer_ranges(n, chunks, counts, want):
    ranges = layer_ranges(n, chunks, counts)
    assert [len(r) for r in ranges] == want
    assert [i for r in ranges for i in r] == list(range(n))


def test_layer_ranges_rejects_bad_counts():
    with pytest.raises(ValueError, match="summing to 8"):
        layer_ranges(8, 2, (3, 4))


def test_chunks_keep_global_names_and_single_device_weights():
    cfg = load_config(
        None, ["--model.n_layers", "4", "--model.dim", "32", "--model.n_heads", "4"]
    ).model
    fam = family(cfg.family)
    whole = build_model(cfg)
    whole.to_empty(device="cpu")
    whole.init_weights(3)
    ranges = layer_ranges(4, 2)
    first = fam.pipeline_chunk(copy.deepcopy(build_model(cfg)), ranges[0], True, False)
    last = fam.pipeline_chunk(copy.deepcopy(build_model(cfg)), ranges[1], False, True)
    for chunk in (first, last):
        chunk.to_empty(device="cpu")
        chunk.init_weights(3)
    ref = dict(whole.named_parameters())
    names = [n for c in (first, last) for n, _ in c.named_parameters()]
    assert sorted(names) == sorted(ref)  # untied: every parameter exactly once
    for chunk in (first, last):
        for name, p in chunk.named_parameters():
            assert torch.equal(p, ref[name]), name
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    hidden = first(tokens)
    assert hidden.shape == (2, 8, cfg.dim)
    torch.testing.assert_close(last(hidden), whole(tokens))


@pytest.mark.parametrize("kind,pp,vpp", [("1f1b", 4, 1), ("zb-v", 2, 2), ("dualpipe", 4, 1)])
def test_forward_only_schedule_covers_the_first_pipe(kind, pp, vpp):
    base = build_schedule(kind, pp, 2 * pp, vpp)
    fwd = add_communication(forward_only(base, 3))
    assert fwd.pipes[0].stages == base.pipes[0].stages and len(fwd.pipes) == 1
    assert all(a.kind.value in ("F", "SEND_F", "RECV_F") for acts in fwd.actions for a in acts)
    assert sum(a.kind.value == "F" for acts in fwd.actions for a in acts) == 3 * fwd.n_stages


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            [
                "--parallel.pp",
                "2",
                "--parallel.pp_schedule",
                "dualpipe",
                "--parallel.microbatches",
                "3",
            ],
            "DualPipe needs",
        ),
        (["--parallel.pp", "2", "--parallel.pp_layers", "1,1"], "must give 2 chunks"),
        (["--parallel.pp", "2", "--parallel.zero", "3", "--parallel.dp", "1"], "zero = 3"),
        (["--parallel.microbatches", "4"], "need parallel.pp > 1"),
        (["--parallel.pp", "4", "--model.n_layers", "2"], "model.n_layers (2) < 4"),
    ],
)
def test_pipeline_config_problems_are_named(overrides, message):
    world = 4 if "4" in overrides[:2] else 2 if "--parallel.pp" in overrides else 1
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, world_size=world)
    assert message in str(err.value)
