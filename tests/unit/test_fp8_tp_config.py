"""FP8 with tensor parallelism: what the config accepts, and the shard-alignment errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperloom.config import ConfigError, config_from_dict
from hyperloom.engine.fp8 import (
    BlockwiseScaling,
    CurrentScaling,
    Fp8Linear,
    MXFP8Scaling,
    fp8_linear,
)
from hyperloom.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

MODEL = {"dim": 256, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 512, "vocab_size": 128}


def job(fp8: str, tp: int = 2, pp: int = 1, **model) -> dict:
    return {
        "model": {**MODEL, **model},
        "parallel": {"tp": tp, "pp": pp},
        "precision": {"fp8": fp8},
    }


@pytest.mark.parametrize("fp8", ["current", "delayed", "rowwise", "blockwise", "mxfp8"])
def test_fp8_with_tp_is_accepted(fp8):
    assert config_from_dict(job(fp8), world_size=2).precision.fp8 == fp8


@pytest.mark.parametrize(("fp8", "block"), [("blockwise", 128), ("mxfp8", 32)])
def test_misaligned_shards_are_rejected(fp8, block):
    with pytest.raises(ConfigError, match=f"multiple of the {block}-element scale block"):
        config_from_dict(job(fp8, ffn_dim=block * 3), world_size=2)


@pytest.mark.parametrize("fp8", ["current", "delayed", "blockwise"])
def test_fp8_with_pp_is_accepted(fp8):
    cfg = config_from_dict(job(fp8, tp=1, pp=2, n_layers=2), world_size=2)
    assert (cfg.precision.fp8, cfg.parallel.pp) == (fp8, 2)


class _Group:  # only world size and rank are read before any collective
    pass


@pytest.mark.parametrize("recipe", [BlockwiseScaling(), MXFP8Scaling()])
def test_tp_layers_check_block_alignment(monkeypatch, recipe):
    import hyperloom.parallel.tensor_parallel as tpl

    monkeypatch.setattr(tpl, "_world", lambda g: 1 if g is None else 2)
    monkeypatch.setattr(tpl, "_rank", lambda g: 0)
    width = recipe.block * 3  # shards of 1.5 blocks
    lin = Fp8Linear.from_linear(nn.Linear(width, width, bias=False, device="meta"), recipe)
    with pytest.raises(ValueError, match=f"multiple of the {recipe.block}-element"):
        ColumnParallelLinear(lin, _Group())
    with pytest.raises(ValueError, match=f"multiple of the {recipe.block}-element"):
        RowParallelLinear(lin, _Group(), False)
    ok = Fp8Linear.from_linear(nn.Linear(4 * recipe.block, 64, device="meta"), recipe)
    assert RowParallelLinear(ok, _Group(), False).recipe is recipe
    assert ColumnParallelLinear(nn.Linear(64, 64, device="meta"), None).recipe is None


@pytest.mark.parametrize("recipe", [CurrentScaling(), BlockwiseScaling()])
def test_reduce_amax_hook_makes_shards_quantize_like_the_whole(recipe):
    """Two column shards of a weight, each given the other's amax through `reduce_amax`
    (what the tp all-reduce MAX does), produce the whole layer's output slices exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=g)
    w = torch.randn(256, 256, generator=g)
    w[:128] *= 10  # the shards' own amaxes differ a lot
    whole = fp8_linear(x, w, None, recipe)
    amax = torch.stack([w[:128].abs().amax(), w[128:].abs().amax()])

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return torch.maximum(t, amax.max().view_as(t))

    hooks = {"weight": reduce, "grad_output": reduce}
    parts = [
        fp8_linear(x, w[s], None, recipe, reduce_amax=hooks)
        for s in (slice(0, 128), slice(128, 256))
    ]
    assert torch.equal(torch.cat(parts, dim=1), whole)
    alone = fp8_linear(x, w[128:], None, recipe)  # without the hook: its own scale
    assert torch.equal(alone, whole[:, 128:]) == isinstance(recipe, BlockwiseScaling)


def test_rowwise_shards_reduce_row_amaxes_like_the_whole():
    """Rowwise under tp with two shards, the all-reduce MAX played by callbacks that add the
    other shard's row amaxes: a row-parallel layer's (K split) output and a column-parallel
    layer's (N split) input gradient equal the whole layer's up to FP32 summation order;
    without the reduction the shards' own row scales give other numbers."""
    from hyperloom.engine.fp8 import RowwiseScaling

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=g)
    w = torch.randn(128, 256, generator=g)
    x[:, :128] *= 10  # the halves of each row have very different amaxes
    w[:64] *= 10
    dy = torch.randn(8, 128, generator=g)
    recipe = RowwiseScaling()
    halves = (slice(0, 128), slice(128, 256))

    def grads(xs, ws, dys, hooks=None):
        xs, ws = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        y = fp8_linear(xs, ws, None, recipe, reduce_amax=hooks)
        (y * dys).sum().backward()
        return y.detach(), xs.grad

    y, dx = grads(x, w, dy)

    def with_rows(other: torch.Tensor):  # row amaxes of the other shard, max-reduced
        return lambda t: torch.maximum(t, other.abs().amax(1, keepdim=True))

    # Row-parallel: x and W split along K; their row amaxes are reduced in forward.
    parts, alone = [], []
    for s, o in zip(halves, halves[::-1], strict=True):
        hooks = {"input": with_rows(x[:, o]), "weight": with_rows(w[:, o])}
        parts.append(grads(x[:, s], w[:, s], dy, hooks)[0])
        alone.append(grads(x[:, s], w[:, s], dy)[0])
    assert torch.allclose(sum(parts), y, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(sum(alone), y, rtol=1e-5, atol=1e-4)

    # Column-parallel: W and dy split along N; dy's and Wᵀ's rows (along N) are reduced.
    n_halves = (slice(0, 64), slice(64, 128))
    parts = []
    for s, o in zip(n_halves, n_halves[::-1], strict=True):
        dy_o, wt_o = dy[:, o], w[o].t()

        def reduce(t: torch.Tensor, dy_o=dy_o, wt_o=wt_o) -> torch.Tensor:
            return with_rows(dy_o if t.shape[0] == dy_o.shape[0] else wt_o)(t)

        y_s, dx_s = grads(x, w[s], dy[:, s], {"weight": reduce, "grad_output": reduce})
        assert torch.equal(y_s, y[:, s])  # forward is local: K is whole
        parts.append(dx_s)
    assert torch.allclose(sum(parts), dx, rtol=1e-5, atol=1e-4)
