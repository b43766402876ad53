"""Activation recompute (`train.recompute`, hyperloom.parallel.recompute) in one process:
every policy trains exactly as no recompute does -- losses, gradient norms and final weights
bitwise in fp32, since the recomputed forward runs the same kernels in the same order -- with
dropout, FP8 (delayed scaling replays its scales and records no amax twice) and the MoE
balancing bias (expert loads counted once); and each policy keeps fewer saved bytes, in the
order the planner ranks them."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from hyperloom.config import ConfigError, load_config
from hyperloom.engine.fp8.convert import fp8_modules
from hyperloom.models.registry import build_model, family
from hyperloom.parallel.parallelize import materialize, select_ops
from hyperloom.parallel.recompute import apply_recompute
from hyperloom.planner import ModelSpec
from hyperloom.planner.memory import saved_bytes as planned_saved
from hyperloom.planner.model import build_layer
from hyperloom.train.trainer import Trainer

POLICIES = ["full", "selective", "core_attn", "mlp_act", "norm", "core_attn,mlp_act,norm"]

MOE = dict(
    model__preset="moe-tiny",
    model__dim=64,
    model__n_layers=3,
    model__n_heads=4,
    model__n_kv_heads=4,
    model__ffn_dim=128,
    model__moe_ffn_dim=32,
    model__vocab_size=512,
    model__max_seq_len=64,
    model__moe_bias_rate=1e-3,
)


def train(tiny_job_args, policy: str, **overrides) -> tuple[list, dict, Trainer]:
    """(per-step loss and grad norm, final weights, trainer) of 4 steps under `policy`."""
    run_dir = Path(tempfile.mkdtemp())
    args = tiny_job_args(run_dir, train__steps=4, train__recompute=policy, **overrides)
    trainer = Trainer(load_config(None, args))
    trainer.run()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["loss"], r["grad_norm"]) for r in records if r.get("event") == "train"]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return steps, weights, trainer


def assert_same(a, b) -> None:
    assert a[0] == b[0], (a[0], b[0])  # losses and gradient norms, every step
    bad = [n for n in a[1] if not torch.equal(a[1][n], b[1][n])]
    assert not bad, bad[:5]


@pytest.fixture(scope="module")
def reference(tiny_job_args):
    return {
        "llama": train(tiny_job_args, "none", model__dropout=0.1),
        "moe": train(tiny_job_args, "none", **MOE),
    }


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_trains_like_no_recompute(reference, tiny_job_args, policy):
    """Llama with dropout (the recomputed forward draws the same masks)."""
    assert_same(train(tiny_job_args, policy, model__dropout=0.1), reference["llama"])


@pytest.mark.parametrize(
    "policy", ["full", "selective", "norm", "experts", "mlp_act,experts", "mla_up,core_attn"]
)
def test_moe_recompute_routes_and_counts_loads_once(reference, tiny_job_args, policy):
    """DeepSeek family (MLA, MoE, MTP): same weights, and the balancing bias moved by the
    step's loads counted once (a second count would move it twice as far)."""
    got = train(tiny_job_args, policy, **MOE)
    assert_same(got, reference["moe"])
    bias = {n: w for n, w in got[1].items() if n.endswith("expert_bias")}
    assert bias and all(w.abs().sum() > 0 for w in bias.values())  # it moved, and (above)
    # moved as far as without recompute


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_fp8_recompute_replays_the_forward_scales(tiny_job_args, recipe):
    """Delayed scaling: a recomputed forward quantizes with the first pass's scales and
    records no amax, so the histories and every update equal the run without recompute."""
    fp8 = dict(precision__fp8=recipe, precision__fp8_bf16_first_layers=0)
    fp8["precision__fp8_bf16_last_layers"] = 0
    plain = train(tiny_job_args, "none", **fp8)
    full = train(tiny_job_args, "full", **fp8)
    assert_same(full, plain)
    for (name, a), (_, b) in zip(
        fp8_modules(full[2].model), fp8_modules(plain[2].model), strict=True
    ):
        if a.fp8_amax_history is not None:
            assert torch.equal(a.fp8_amax_history, b.fp8_amax_history), name
            assert torch.equal(a.fp8_scale, b.fp8_scale), name


def saved_bytes(tiny_job_args, policy: str) -> int:
    """Bytes autograd keeps after one training forward of a 2-block model (dim 128, 4 x 64
    tokens), storages counted once, dropped outputs at their size after the drop."""
    cfg = load_config(None, tiny_job_args(tempfile.mkdtemp(), model__dim=128, model__ffn_dim=512))
    model = build_model(cfg.model)
    apply_recompute(model, policy, 0, family("llama").recompute_plan(cfg.model))
    materialize(model, torch.device("cpu"), 0)
    select_ops(model, cfg)
    model.train()
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t
        return t

    tokens = torch.randint(
        0, cfg.model.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0)
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels=tokens)
    total = sum(t.untyped_storage().nbytes() for t in saved.values())
    loss.backward()  # the dropped outputs come back for it
    return total


def test_each_policy_keeps_less(tiny_job_args):
    b = {p: saved_bytes(tiny_job_args, p) for p in ["none", *POLICIES]}
    assert b["none"] > b["norm"] > b["core_attn,mlp_act,norm"] > b["full"]
    assert b["none"] > b["core_attn"] and b["none"] > b["mlp_act"] > b["selective"]
    assert b["selective"] > b["core_attn,mlp_act,norm"]
    assert b["full"] < 0.1 * b["none"]  # only the blocks' inputs (kept by the checkpoints)


def block_saved_bytes(cfg, policy: str) -> int:
    """Bytes the transformer blocks keep for the backward in one forward (parameters and
    buffers not counted, each storage once)."""
    model = build_model(cfg.model)
    apply_recompute(model, policy, 0, family(cfg.model.family).recompute_plan(cfg.model))
    materialize(model, torch.device("cpu"), 0)
    select_ops(model, cfg)
    model.train()
    constant = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    inside, saved = [False], {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] and t.untyped_storage()._cdata not in constant:
            saved[t.untyped_storage()._cdata] = t
        return t

    for block in model.layers.values():
        block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=tokens)
    return sum(t.untyped_storage().nbytes() for t in saved.values())


@pytest.mark.parametrize(
    "policy", ["mlp_act", "experts", "mlp_act,experts", "norm", "mla_up", "mla_up,core_attn"]
)
def test_the_planner_frees_what_a_deepseek_policy_frees(tiny_job_args, policy):
    """DeepSeek family in fp32: what a policy frees in the blocks, measured, equals the
    planner's figure for the same layers (`planner.model`'s mean layer x n_layers): the
    shared experts' activation under mlp_act, the routed bank's internals under experts, the
    per-head q, k, v and the core's lse under mla_up (q/k head dim = v head dim here, so that
    CPU attention takes the flash path the planner assumes)."""
    cfg = load_config(None, tiny_job_args(tempfile.mkdtemp(), **MOE, model__qk_nope_head_dim=16))
    spec = ModelSpec.from_model_config(cfg.model)
    layer = build_layer(spec, 2, 64, 1, 1, False, act_width=4)
    predicted = (planned_saved(layer, "none") - planned_saved(layer, policy)) * spec.n_layers
    freed = block_saved_bytes(cfg, "none") - block_saved_bytes(cfg, policy)
    # to 1e-3: the routed bank also keeps its (experts,) int32 group offsets, 64 B a layer here
    assert freed > 0 and freed == pytest.approx(predicted, rel=1e-3), (freed, predicted)


def test_recompute_layers_limits_the_blocks(tiny_job_args):
    cfg = load_config(None, tiny_job_args(tempfile.mkdtemp()))
    model = build_model(cfg.model)
    plan = family("llama").recompute_plan(cfg.model)
    assert apply_recompute(model, "full", 1, plan) == 1
    assert apply_recompute(build_model(cfg.model), "none", 0, plan) == 0


def test_an_unknown_policy_is_a_config_error(tiny_job_args):
    with pytest.raises(ConfigError, match="train.recompute: unknown recompute module"):
        load_config(None, tiny_job_args(tempfile.mkdtemp(), train__recompute="attn"))


def test_a_recomputed_moe_forward_counts_its_loads_once(tiny_job_args):
    """The loads the balancing bias moves by: tokens x top-k per micro-batch, not twice that
    (the sign-based bias update alone cannot tell, so the counts are checked here)."""
    cfg = load_config(None, tiny_job_args(tempfile.mkdtemp(), **MOE))
    model = build_model(cfg.model)
    apply_recompute(model, "full", 0, family("deepseek").recompute_plan(cfg.model))
    materialize(model, torch.device("cpu"), 0)
    model.train()
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    model(tokens, labels=tokens).backward()
    layers = model.moe_layers()
    assert layers
    for name, moe in layers.items():
        positions = 64 if name.startswith("layers.") else 63  # MTP predicts one further
        assert moe.counts.sum().item() == 2 * positions * cfg.model.moe_top_k, name


def test_recompute_under_torch_compile(tiny_job_args):
    """`train.compile` with full recompute: the compiler fuses a checkpointed block otherwise
    than a plain one, so equal within round-off rather than bitwise (7e-8 relative measured)."""
    plain = train(tiny_job_args, "none", train__compile=True)
    full = train(tiny_job_args, "full", train__compile=True)
    for (la, ga), (lb, gb) in zip(full[0], plain[0], strict=True):
        assert abs(la - lb) <= 1e-6 * abs(lb) and abs(ga - gb) <= 1e-5 * abs(gb)
