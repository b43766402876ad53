"""The memory terms a training job adds beyond the device-memory model, against hand-worked
bytes: ZeRO-1's states, the fused cross-entropy's kept gradients and chunk temporaries, and a
CPU profile's allocator retention."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from hyperloom.config import ModelConfig, load_config
from hyperloom.engine.ops.cross_entropy import auto_chunk_tokens, linear_cross_entropy
from hyperloom.engine.ops.memory import AllocationTracker
from hyperloom.planner.hardware import Cluster, get_profile
from hyperloom.planner.memory import (
    ce_chunk_tokens,
    ce_working_bytes,
    chunk_activation_extras,
    states,
)
from hyperloom.planner.model import ModelSpec
from hyperloom.planner.simulate import predict
from hyperloom.planner.strategy import RUNTIMES, Runtime, Strategy, job_runtime

# A small Llama: dim 64, vocab 1000, 2 layers.
SMALL = ModelSpec(ModelConfig(preset="small", n_layers=2, dim=64, n_heads=4, n_kv_heads=2,
                              ffn_dim=128, vocab_size=1000))  # fmt: skip


def test_zero1_states_and_its_flat_gradient_copy():
    s = Strategy(dp=4, zero=1, microbatches=1)
    # 1000 params: param 4000 + grad 4000 + (master 4 + Adam 8) * 1000 / 4
    assert states(1000, s, job_runtime()) == pytest.approx((4000, 4000, 3000))
    assert states(1000, Strategy(dp=4, zero=0), job_runtime())[2] == pytest.approx(8000)
    # FP32 gradients are views of ZeRO-1's buffer: no flattened copy at the update; BF16
    # parameters' gradients are flattened into an FP32 one (4 B/param more in the step peak)
    fp32 = predict(SMALL, Cluster.of("h100", 4), s, 16, job_runtime()).memory[0]
    bf16 = job_runtime().with_param_dtype("bf16")
    half = predict(SMALL, Cluster.of("h100", 4), s, 16, bf16).memory[0]
    n = SMALL.params()
    assert fp32.step_peak == pytest.approx(fp32.params + fp32.grads + fp32.optimizer)
    assert half.step_peak == pytest.approx(half.params + half.grads + half.optimizer + 4 * n)
    # Megatron's gradients accumulate in one FP32 main_grad buffer: no copy either
    mega = predict(SMALL, Cluster.of("h100", 4), s, 16, RUNTIMES["megatron"]).memory[0]
    assert mega.step_peak == pytest.approx(mega.params + mega.grads + mega.optimizer)


def test_fused_head_keeps_its_gradients_not_logits():
    s = Strategy(mbs=2, microbatches=1)
    # 2 x 16 tokens: final-norm input 2*32*64 + input grad 4*32*64 + weight grad 4*1000*64
    assert chunk_activation_extras(SMALL, s, 16, False, True, True) == 4096 + 8192 + 256000
    # the unfused head: norm and head inputs 2 * 2*32*64, FP32 logits 4*32*1000
    assert chunk_activation_extras(SMALL, s, 16, False, True) == 8192 + 128000
    tp2 = dataclasses.replace(s, tp=2, sp=False)  # vocab-parallel: half the weight gradient
    assert chunk_activation_extras(SMALL, tp2, 16, False, True, True) == 4096 + 8192 + 128000
    sp = dataclasses.replace(tp2, sp=True)  # the norm input is sequence-sharded
    assert chunk_activation_extras(SMALL, sp, 16, False, True, True) == 2048 + 8192 + 128000


@pytest.mark.parametrize(("tokens", "dim", "vocab"), [(32, 64, 1000), (2048, 384, 16384),
                                                      (8192, 4096, 128256), (1000, 64, 8192)])  # fmt: skip
def test_chunk_rule_is_the_operators(tokens, dim, vocab):
    assert ce_chunk_tokens(tokens, dim, vocab) == auto_chunk_tokens(tokens, dim, vocab)


def test_ce_working_bytes_by_hand():
    # 32 tokens (< the 256-token minimum chunk): BF16 weight copy and ∂W block 2 x 2*1000*64,
    # and 16 B per logit of the one 32-token chunk
    s = Strategy(mbs=2, microbatches=1)
    assert ce_working_bytes(SMALL, s, 16) == 2 * 2 * 1000 * 64 + 16 * 32 * 1000
    # 2048 tokens of a 16k vocabulary split over tp 2: 256-token chunks of 8192 logits
    big = SMALL.with_config(dim=384, vocab_size=16384)
    tp2 = Strategy(tp=2, mbs=8, microbatches=1)
    assert ce_working_bytes(big, tp2, 256) == 2 * 2 * 8192 * 384 + 16 * 256 * 8192
    # a 128k vocabulary at dim 4096: the ∂W block stops at 128 MiB, the weight copy does not
    huge = SMALL.with_config(dim=4096, vocab_size=128256)
    one = Strategy(mbs=1, microbatches=1)
    c = 256  # 1024 tokens: ceil(1024 / ceil(128256 / 4096)) -> 256-token minimum
    assert ce_working_bytes(huge, one, 1024) == 2 * 128256 * 4096 + 2**27 + 16 * c * 128256


@pytest.mark.parametrize(("tokens", "dim", "vocab"), [(1024, 128, 4096), (512, 384, 16384)])
def test_fused_cross_entropy_allocates_what_the_model_says(tokens, dim, vocab):
    """The operator's own allocations: the kept gradients exactly, the forward's peak within
    10% of kept + working (the eager path, as a dispatch mode sees it)."""
    h = torch.randn(tokens, dim, requires_grad=True)
    w = (torch.randn(vocab, dim) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    with AllocationTracker() as t:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = linear_cross_entropy(h, w, labels)
        kept, fwd_peak = t.live_bytes, t.peak_bytes
    loss.backward()
    spec = SMALL.with_config(dim=dim, vocab_size=vocab)
    s = Strategy(mbs=1, microbatches=1)
    extras = chunk_activation_extras(spec, s, tokens, False, True, True)
    assert kept == pytest.approx(extras - 2 * tokens * dim, abs=4096)  # all but the norm input
    assert fwd_peak == pytest.approx(kept + ce_working_bytes(spec, s, tokens), rel=0.1)


def test_host_memory_adds_a_fixed_part_and_a_share_of_the_churn_and_leaves_devices_alone():
    s = Strategy(dp=1, mbs=1, microbatches=1)
    h100 = get_profile("h100")
    cpu = dataclasses.replace(h100, host_runtime_bytes=90e6, host_churn_factor=0.4)
    plain = predict(SMALL, Cluster(h100, 1, 1), s, 16, margin_gib=0)
    held = predict(SMALL, Cluster(cpu, 1, 1), s, 16, margin_gib=0)
    m0, m1 = plain.memory[0], held.memory[0]
    assert m0.allocator == 0 and m0.peak == m0.live
    assert m1.live == pytest.approx(m0.live)
    churned = m0.activations + m0.transient + m0.buffers
    assert churned > 0 and m1.allocator == pytest.approx(90e6 + 0.4 * churned)
    # the older form, resident bytes per live byte, still applies to profiles that carry it
    old = predict(SMALL, Cluster(dataclasses.replace(h100, host_alloc_factor=1.4), 1, 1), s, 16)
    assert old.memory[0].allocator == pytest.approx(0.4 * m0.live)
    assert all(a.host_memory == (1.0, 0.0, 0.0) for a in map(get_profile, ("h100", "a100")))


def test_self_check_runtime_follows_the_job_ops():
    job = load_config(None, ["--ops.fused", "false"])
    assert not Runtime.from_job(job).fused_cross_entropy
    assert Runtime.from_job(load_config(None, [])).fused_cross_entropy


@pytest.mark.parametrize(
    "args,copies",
    [
        (["--precision.fp8", "blockwise"], False),
        (["--precision.fp8", "blockwise", "--precision.fp8_activation", "true"], True),
        (["--precision.fp8", "current"], True),
        (["--precision.fp8", "delayed", "--precision.fp8_high_precision", '["wgrad"]'], False),
        (["--precision.fp8", "mxfp8", "--precision.fp8_activation", "true",
          "--precision.fp8_high_precision", '["fprop", "wgrad"]'], False),
    ],
)  # fmt: skip
def test_self_check_runtime_saves_fp8_inputs_as_the_layers_do(args, copies):
    """What an FP8 layer keeps for backward (engine.fp8.modules): its input's FP8 copy
    under precision.fp8_activation or a per-tensor recipe whose weight gradient is FP8,
    else the input itself -- and the predicted activations follow (half the GEMM inputs)."""
    job = load_config(None, args)
    rt = Runtime.from_job(job)
    assert rt.fp8_saved_inputs is copies
    s = Strategy(dp=1, mbs=1, microbatches=1, fp8=True)
    saved = predict(SMALL, Cluster.of("h100", 1), s, 16, rt, margin_gib=0).memory[0]
    other = dataclasses.replace(rt, fp8_saved_inputs=not copies)
    flipped = predict(SMALL, Cluster.of("h100", 1), s, 16, other, margin_gib=0).memory[0]
    assert (saved.activations < flipped.activations) is copies


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallinfo2 and /proc")
def test_runtime_memory_is_a_line_through_two_fresh_training_processes():
    from hyperloom.planner.host_memory import RUNTIME_BATCHES, fit_runtime_memory
    from hyperloom.train.probe import measure_runtime_memory

    got = fit_runtime_memory([measure_runtime_memory(b, steps=2) for b in RUNTIME_BATCHES])
    if not got:
        pytest.skip("no glibc mallinfo2 here")
    (small, big) = got["runs"]
    assert [small["micro_batch"], big["micro_batch"]] == list(RUNTIME_BATCHES)
    # params and Adam of the ~11M-parameter job in both; the larger batch churns more
    assert 150e6 < small["live_bytes"] < big["live_bytes"]
    assert 0 < small["churn_bytes"] < big["churn_bytes"] < big["live_bytes"]
    assert 0 <= got["churn_factor"] < 3.0 and 0 <= got["fixed_bytes"] < 1e9
    for run in (small, big):  # the line through both runs' surplus (fixed clipped at 0)
        surplus = run["resident_bytes"] - run["live_bytes"]
        line = got["fixed_bytes"] + got["churn_factor"] * run["churn_bytes"]
        assert line == pytest.approx(surplus, rel=1e-6) or got["fixed_bytes"] == 0


def test_runtime_memory_fit_is_the_line_through_two_runs():
    """The fit alone, on made-up runs: surplus 100 MB + 0.5 x churn, and {} if a run is
    missing (no glibc, or a failed process)."""
    from hyperloom.planner.host_memory import fit_runtime_memory

    def run(churn):
        return {"resident_bytes": 1e9 + 100e6 + 0.5 * churn, "live_bytes": 1e9,
                "churn_bytes": churn}  # fmt: skip

    got = fit_runtime_memory([run(40e6), run(200e6)])
    assert got["churn_factor"] == pytest.approx(0.5)
    assert got["fixed_bytes"] == pytest.approx(100e6)
    assert fit_runtime_memory([run(40e6), {}]) == {} and fit_runtime_memory([]) == {}


def test_calibration_takes_the_host_memory_fit_from_the_caller(monkeypatch):
    """`calibrate` fits what the caller's probe measured (the planner runs no trainer); with
    no probe the fit stays 0."""
    from hyperloom.planner import calibrate as cal
    from hyperloom.planner.host_memory import RUNTIME_BATCHES

    monkeypatch.setattr(cal, "measure_gemms", lambda acc, dt, shapes: [(s, 1.0) for s in shapes])
    monkeypatch.setattr(cal, "measure_memory", lambda acc, n: 10.0)
    monkeypatch.setattr(
        cal, "measure_elementwise", lambda *a, **k: {"total_gbs": 5.0, "cast_gbs": 2.0}
    )
    monkeypatch.setattr(cal, "measure_attention", lambda *a: (0.5, 0.4))
    monkeypatch.setattr(cal, "measure_layer_overhead", lambda acc, dt: 1e-3)
    asked = []

    def probe(micro_batch: int, policy: str) -> dict:
        asked.append((micro_batch, policy))
        churn = 10e6 * micro_batch
        return {"micro_batch": micro_batch, "resident_bytes": 300e6 + 80e6 + 0.25 * churn,
                "live_bytes": 300e6, "churn_bytes": churn}  # fmt: skip

    profile, raw = cal.calibrate("cpu", quick=True, collectives=False, runtime_memory=probe)
    assert asked == [(b, "cache") for b in RUNTIME_BATCHES]
    assert profile.host_runtime_bytes == pytest.approx(80e6)
    assert profile.host_churn_factor == pytest.approx(0.25)
    assert raw["runtime_memory"]["churn_factor"] == pytest.approx(0.25)
    bare, raw = cal.calibrate("cpu", quick=True, collectives=False)
    assert bare.host_runtime_bytes == 0 and bare.host_churn_factor == 0
    assert "runtime_memory" not in raw


@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk-norm"])
def test_saved_tensors_per_layer_are_the_runtimes(qk_norm):
    """`autocast_per_op`: a layer's saved bytes equal what our Llama's autograd keeps under
    BF16 autocast (unique storages seen by `saved_tensors_hooks`, minus the weights' BF16
    casts, which the memory model counts as buffers): the FP32 norm inputs and one BF16 cast
    of the norm output per q/k/v and w1/w3 linear; with qk-norm also the per-head norms'
    BF16 inputs and their FP32 1/rms per head row."""
    from hyperloom.config import ModelConfig
    from hyperloom.models.registry import init_model
    from hyperloom.planner.memory import saved_bytes
    from hyperloom.planner.model import build_layer

    cfg = ModelConfig(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64,
        qk_norm=qk_norm,
    )  # fmt: skip
    model = init_model(cfg, "cpu", seed=0)
    mbs, seq = 2, 48  # 96 tokens: no activation shares a weight's shape
    tokens = torch.randint(0, cfg.vocab_size, (mbs, seq + 1))
    # a linear saves its weight's BF16 cast transposed
    weight_shapes = {s for p in model.parameters() if p.ndim == 2 for s in (p.shape, p.shape[::-1])}
    layer = {"now": None}
    seen: dict[int, tuple[str | None, int]] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        cast = t.dtype == torch.bfloat16 and t.shape in weight_shapes
        if key not in seen and not isinstance(t, torch.nn.Parameter) and not cast:
            seen[key] = (layer["now"], t.untyped_storage().nbytes())
        return t

    for name, block in [*model.layers.items(), ("final norm", model.norm)]:
        block.register_forward_pre_hook(lambda m, a, name=name: layer.update(now=name))
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        model(tokens[:, :-1], labels=tokens[:, 1:])
    # layer 1: layer 0 also first saves the shared RoPE tables
    runtime = sum(n for owner, n in seen.values() if owner == "1")
    spec = ModelSpec.from_model_config(cfg, "small")
    per_op = saved_bytes(build_layer(spec, mbs, seq, 1, 1, False, per_op_casts=True), "none")
    plain = saved_bytes(build_layer(spec, mbs, seq, 1, 1, False), "none")
    assert per_op == pytest.approx(runtime, rel=0.01)  # the norms' 1/rms are not modelled
    assert plain < 0.8 * runtime  # one BF16 norm output per block: what Megatron/TE save


def _peak_grads(runtime: str, **strategy):
    from hyperloom.planner.memory import grads_at_peak
    from hyperloom.planner.strategy import RUNTIMES

    rt = dataclasses.replace(RUNTIMES[runtime], fused_cross_entropy=True)
    return grads_at_peak(SMALL, Strategy(**strategy), rt, 1000.0, True)


def test_gradients_at_the_activation_peak_follow_what_holds_them():
    head = 4.0 * SMALL.embedding_params()  # FP32 head gradient the fused loss forms forward
    assert _peak_grads("hyperloom") == pytest.approx(head)  # one micro-batch, one process
    assert _peak_grads("hyperloom", dp=2) == pytest.approx(1000 + head)  # DDP bucket views
    assert _peak_grads("hyperloom", dp=2, zero=1) == pytest.approx(1000 + head)  # flat buffer
    assert _peak_grads("hyperloom", dp=2, zero=3) == pytest.approx(head)  # FSDP2: sharded late
    assert _peak_grads("hyperloom", microbatches=4) == pytest.approx(1000 + head)  # grad_accum
    assert _peak_grads("hyperloom", pp=2, microbatches=4) == pytest.approx(head)  # warm-up
    assert _peak_grads("megatron") is None  # persistent main-grad buffers: all of them


def test_peak_gradients_enter_the_live_peak_only():
    from hyperloom.planner.memory import Memory

    m = Memory(params=10, grads=8, optimizer=20, activations=30, transient=2, buffers=1,
               step_peak=40, peak_grads=3)  # fmt: skip
    assert m.live == pytest.approx(10 + 3 + 20 + 30 + 2 + 1)
    assert m.states == 38  # the optimizer step holds every gradient
    assert Memory(params=10, grads=8, step_peak=100).live == 100
    assert m.to_dict()["peak_grads"] == 3 and Memory(grads=8).to_dict()["peak_grads"] == 8


def test_context_parallel_ranks_share_the_gradients_and_the_optimizer():
    """Megatron reduces gradients and shards its distributed optimizer over dp x cp: context
    ranks hold the same parameters. dp1 x cp2 with ZeRO-1 shards the optimizer in two and
    pays a gradient reduction, as dp2 does (issue 34, finding 2)."""
    cluster, mega = Cluster.of("h100", 2), RUNTIMES["megatron"]
    cp = predict(SMALL, cluster, Strategy(cp=2, zero=1, microbatches=2), 1024, mega)
    dp = predict(SMALL, cluster, Strategy(dp=2, zero=1, microbatches=1), 1024, mega)
    one = predict(SMALL, Cluster.of("h100", 1), Strategy(zero=1, microbatches=2), 1024, mega)
    assert cp.memory[0].optimizer == pytest.approx(one.memory[0].optimizer / 2)
    assert cp.memory[0].optimizer == pytest.approx(dp.memory[0].optimizer)
    assert cp.breakdown["dp_sync_total"] > 0 and one.breakdown["dp_sync_total"] == 0
