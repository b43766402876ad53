"""FP8 MoE experts: the three expert GEMMs run in FP8 through the engine's grouped linear
(each expert its own scales), `convert_to_fp8` switches them on unless a keep pattern holds
them, the router stays float32, and a small MoE trains like BF16. Delayed scaling keeps
one amax history per expert, GEMM and role: checked bitwise against three Fp8Linear per
expert run by hand (an idle expert taking TE's turn for an empty split), in eval mode it
changes nothing, it resumes bitwise through the model's state dict, and a whole (E, ...)
state loads into expert-parallel ranks as each rank's experts' rows.

Bounds (measured here, relative Frobenius error against FP32; 4 experts, dim 256, hidden
384, tokens per expert 40 / 0 / 17 / 199, so one idle expert and counts that are not
multiples of 128): output 0.066 (every recipe), input gradient 0.093 (current, E5M2
gradients) and 0.068 (blockwise, E4M3), weight gradients 0.095 and 0.070. Delayed (hybrid,
measured on its second step, scaled from the first one's amaxes): 0.065, 0.093 and 0.095.
Asserted with a margin: 0.08 forward, 0.12 hybrid-format gradients, 0.085 E4M3 ones. These
are the errors of E4M3/E5M2 rounding (about 3.6% / 7% RMS per element) through two GEMMs and
SwiGLU, not of the grouping.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from hyperloom.config import preset_config
from hyperloom.engine import ops
from hyperloom.engine.fp8 import (
    DEFAULT_KEEP,
    DelayedScaling,
    Fp8Linear,
    convert_to_fp8,
    fp8_state_dict,
    load_fp8_state_dict,
    quantize_for,
    recipe_from_name,
)
from hyperloom.engine.fp8.recipes import observe_empty
from hyperloom.engine.ops import OpImpls
from hyperloom.models.deepseek.moe import Router
from hyperloom.models.experts import Experts
from hyperloom.models.registry import build_model, init_model
from hyperloom.parallel.expert_parallel import ExpertParallelExperts

CFG = dataclasses.replace(
    preset_config("moe-tiny"),
    vocab_size=128,
    dim=128,
    n_layers=2,
    n_dense_layers=1,
    n_heads=2,
    n_kv_heads=2,
    ffn_dim=256,
    n_routed_experts=4,
    n_shared_experts=1,
    moe_top_k=2,
    moe_ffn_dim=128,
    moe_n_groups=1,
    moe_topk_groups=1,
    q_lora_rank=0,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    mtp_depth=0,
    max_seq_len=32,
)
FWD_BOUND, GRAD_BOUND = 0.08, {"hybrid": 0.12, "e4m3": 0.085}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("recipe", ["delayed", "current", "rowwise", "blockwise", "mxfp8"])
def test_fp8_experts_forward_and_backward_within_bounds(recipe):
    torch.manual_seed(0)
    counts = torch.tensor([40, 0, 17, 199])
    experts = Experts(4, 256, 384)
    with torch.no_grad():
        for w in experts.parameters():
            w.copy_(torch.randn_like(w) * w.shape[-1] ** -0.5)
    x0, dy = torch.randn(2, int(counts.sum()), 256).unbind()

    def run() -> tuple[torch.Tensor, ...]:
        for p in experts.parameters():
            p.grad = None
        x = x0.clone().requires_grad_()
        y = experts(x, counts)
        y.backward(dy)
        return (y.detach(), x.grad, *(p.grad for p in experts.parameters()))

    ref = run()
    assert experts.enable_fp8(recipe_from_name(recipe))
    got = run()
    if recipe == "delayed":  # the first step has empty histories (unit scales): measure the
        got = run()  # second, scaled from the first one's amaxes
    bound = GRAD_BOUND[experts.recipe.fp8_format]
    assert 0 < _rel(got[0], ref[0]) < FWD_BOUND  # FP8 ran, and stays close
    assert all(_rel(g, r) < bound for g, r in zip(got[1:], ref[1:], strict=True))
    assert all(torch.equal(g[1], torch.zeros_like(g[1])) for g in got[2:])  # the idle expert


def test_convert_switches_experts_keeps_router_and_honours_keep():
    model = build_model(CFG)  # meta device
    names = convert_to_fp8(model, recipe_from_name("blockwise"), DEFAULT_KEEP)
    moe = model.layers["1"].feed_forward
    assert "layers.1.feed_forward.experts" in names
    assert moe.experts.recipe.name == "blockwise"
    assert type(moe.router) is Router  # a float32 F.linear on its own weight: untouched
    assert isinstance(moe.shared.w1, Fp8Linear)  # shared experts are plain linears

    kept = build_model(CFG)
    names = convert_to_fp8(kept, recipe_from_name("current"), [*DEFAULT_KEEP, "*experts*"])
    assert kept.layers["1"].feed_forward.experts.recipe is None
    assert not any("experts" in n for n in names)

    delayed = build_model(CFG)  # per-expert histories: (experts, len, 3 GEMMs x 3 roles)
    assert "layers.1.feed_forward.experts" in convert_to_fp8(
        delayed, recipe_from_name("delayed"), DEFAULT_KEEP
    )
    experts = delayed.layers["1"].feed_forward.experts
    assert experts.recipe.name == "delayed"
    assert experts.fp8_amax_history.shape == (4, 1024, 9) and experts.fp8_scale.shape == (4, 9)


def _setup(fp8: str | None) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
    model = init_model(CFG, "cpu", 0).use_ops(OpImpls.choose(compile=False)).train()
    if fp8:
        convert_to_fp8(model, recipe_from_name(fp8), DEFAULT_KEEP)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    return model, opt, torch.Generator().manual_seed(0)


def _steps(model, opt, gen: torch.Generator, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):  # learnable sequences t_i = start + stride * i (mod vocab)
        start = torch.randint(0, 128, (8, 1), generator=gen)
        stride = torch.randint(1, 4, (8, 1), generator=gen)
        tokens = (start + stride * torch.arange(33)) % 128
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.after_optimizer_step(None)
        losses.append(loss.item())
    return losses


def _train(fp8: str | None, steps: int = 12) -> list[float]:
    return _steps(*_setup(fp8), steps)


def test_small_moe_trains_with_fp8_experts_like_bf16():
    """12 AdamW steps under BF16 autocast, loss 4.88 -> 2.33: blockwise, current and delayed
    (every linear, experts included) end within 1% of BF16 at every step (measured 0.14%,
    0.17% and 0.19% at worst)."""
    ref = _train(None)
    assert ref[-1] < 0.6 * ref[0]  # it learns
    for fp8 in ("blockwise", "current", "delayed"):
        model, opt, gen = _setup(fp8)
        got = _steps(model, opt, gen, 12)
        assert model.layers["1"].feed_forward.experts.recipe.name == fp8
        worst = max(abs(a - b) / b for a, b in zip(got, ref, strict=True))
        assert worst < 0.01, (fp8, worst, got, ref)


# --------------------------------------------------------------------------- delayed scaling

WINDOW = 3
# Tokens per expert in each micro-batch: expert 2 idles for 4 > WINDOW micro-batches, so its
# input history empties completely before it gets tokens again.
SCHEDULE = [[5, 0, 3], [2, 4, 0], [0, 6, 0], [4, 1, 0], [3, 2, 0], [1, 2, 5], [2, 0, 4]]


def _idle_turn_by_hand(lin: Fp8Linear, recipe: DelayedScaling) -> None:
    """An idle expert's linear takes TE's turn for an empty split: its weight is quantized
    (amax recorded), its input and output gradient record amax 0."""
    st = lin._states(recipe)
    observe_empty(recipe, "input", st["input"])
    quantize_for(lin.weight.detach(), recipe, "weight", st["weight"])
    observe_empty(recipe, "grad_output", st["grad_output"])


@pytest.mark.parametrize(("algo", "margin"), [("max", 0), ("most_recent", 1)])
def test_delayed_experts_equal_per_expert_fp8_linears(algo, margin):
    """Each expert keeps its own window per GEMM and role: the experts' outputs, input
    gradients, weight gradients and every expert's (len, 9) history and scales equal --
    bitwise -- three Fp8Linear per expert run by hand on that expert's rows; and the scale of
    w1's input follows the formula fp8_max / amax(window before the step) / 2^margin."""
    recipe = DelayedScaling(amax_history_len=WINDOW, amax_compute_algo=algo, margin=margin)
    torch.manual_seed(0)
    n, dim, hidden = 3, 32, 48
    experts = Experts(n, dim, hidden)
    with torch.no_grad():
        for w in experts.parameters():
            w.copy_(torch.randn_like(w) * w.shape[-1] ** -0.5)
    assert experts.enable_fp8(recipe)
    lins = []
    for e in range(n):
        trio = [
            Fp8Linear(dim, hidden, False, recipe=recipe),
            Fp8Linear(dim, hidden, False, recipe=recipe),
        ]
        trio.append(Fp8Linear(hidden, dim, False, recipe=recipe))
        with torch.no_grad():
            for lin, w in zip(trio, (experts.w1, experts.w3, experts.w2), strict=True):
                lin.weight.copy_(w[e])
        lins.append(trio)
    amaxes: list[list[float]] = [[] for _ in range(n)]  # w1's input amax per step, 0 if idle
    swiglu = OpImpls().swiglu
    for t, sizes in enumerate(SCHEDULE):
        x = (torch.randn(sum(sizes), dim) * (1 + t)).requires_grad_()  # growing: scales move
        dy = torch.randn(sum(sizes), dim)
        y = experts(x, torch.tensor(sizes))
        y.backward(dy)
        for e, rows in enumerate(torch.arange(sum(sizes)).split(sizes)):
            l1, l3, l2 = lins[e]
            idle = rows.numel() == 0
            xs = x.detach()[rows].requires_grad_()
            amaxes[e].append(0.0 if idle else xs.abs().max().item())
            if idle:
                for lin in (l1, l3, l2):
                    _idle_turn_by_hand(lin, recipe)
                continue
            ye = l2(ops.swiglu(l1(xs), l3(xs), swiglu))
            ye.backward(dy[rows])
            assert torch.equal(y[rows], ye) and torch.equal(x.grad[rows], xs.grad), (t, e)
            assert torch.isfinite(ye).all()
        for e, trio in enumerate(lins):
            for j, lin in enumerate(trio):
                cols = slice(3 * j, 3 * j + 3)
                assert torch.equal(experts.fp8_amax_history[e][:, cols], lin.fp8_amax_history)
                assert torch.equal(experts.fp8_scale[e][cols], lin.fp8_scale), (t, e, j)
            # The scale step t used: from the window of amaxes of steps t - len .. t - 1.
            window = amaxes[e][max(0, t - WINDOW) : t]
            picked = (max(window) if algo == "max" else window[-1]) if window else 0.0
            if picked > 0:
                want = 448.0 / torch.tensor(picked) / 2.0**margin
                assert experts.fp8_scale[e, 0].item() == pytest.approx(want.item(), rel=1e-6)
    for j, w in enumerate((experts.w1, experts.w3, experts.w2)):
        for e in range(n):
            assert torch.equal(w.grad[e], lins[e][j].weight.grad), (j, e)
    idle = experts.fp8_scale[2]  # expert 2 idled past its window and came back: still valid
    assert torch.isfinite(idle).all() and (idle > 1).all()


def test_delayed_experts_in_eval_leave_the_state_alone():
    torch.manual_seed(0)
    experts = Experts(3, 32, 48)
    with torch.no_grad():
        for w in experts.parameters():
            w.copy_(torch.randn_like(w) * 0.1)
    experts.enable_fp8(DelayedScaling(amax_history_len=4))
    counts = torch.tensor([4, 0, 2])
    experts(torch.randn(6, 32), counts).sum().backward()
    before = {k: v.clone() for k, v in experts.state_dict().items() if k.startswith("fp8")}
    experts.eval()
    x = torch.randn(6, 32, requires_grad=True)
    y = experts(x, counts)
    y.sum().backward()
    assert all(torch.equal(experts.get_buffer(k), v) for k, v in before.items())
    experts.train()
    experts(x, counts).sum().backward()
    assert not torch.equal(experts.fp8_amax_history, before["fp8_amax_history"])


def test_delayed_expert_state_resumes_bitwise_through_the_model_state_dict():
    """3 delayed steps, save (model state dict with the experts' histories, optimizer, data
    position), 2 more; a fresh model loaded from the save takes the same 2 steps bitwise. A
    model loaded without the experts' scaling state does not (the state matters)."""
    key = "layers.1.feed_forward.experts.fp8_amax_history"
    model, opt, gen = _setup("delayed")
    _steps(model, opt, gen, 3)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), gen.get_state()))
    assert key in saved[0] and saved[0][key].abs().amax() > 0
    assert torch.equal(fp8_state_dict(model)[key], saved[0][key])  # the trainer's "fp8" view
    want = _steps(model, opt, gen, 2)

    def resumed(state: dict) -> tuple[list[float], bool]:
        again, opt2, gen2 = _setup("delayed")
        again.load_state_dict(state)
        opt2.load_state_dict(saved[1])
        gen2.set_state(saved[2])
        losses = _steps(again, opt2, gen2, 2)
        same = all(
            torch.equal(a, b)
            for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True)
        )
        return losses, same

    got, same = resumed(saved[0])
    assert got == want and same
    lost = {
        k: v for k, v in saved[0].items() if not (k.startswith("layers.1") and "experts.fp8" in k)
    }
    got, same = resumed(lost)  # a strict load keeps the fresh (empty) expert state
    assert not same


def test_whole_expert_state_loads_into_expert_parallel_ranks():
    """A whole (E, len, 9) history (one process, or ep gathered) loads into ep = 2 ranks as
    expert e's rows on rank e // 2; a state that does not split over the ranks is refused."""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    whole = Experts(4, 16, 24)
    with torch.no_grad():
        for w in whole.parameters():
            w.copy_(torch.randn_like(w) * 0.2)
    whole.enable_fp8(recipe)
    whole(torch.randn(10, 16), torch.tensor([3, 0, 5, 2])).sum().backward()
    saved = fp8_state_dict(torch.nn.ModuleDict({"experts": whole}))
    for rank in (0, 1):
        mine = ExpertParallelExperts(Experts(4, 16, 24), None, rank, 2, "alltoall")
        mine.enable_fp8(recipe)
        load_fp8_state_dict(torch.nn.ModuleDict({"experts": mine}), saved)
        rows = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(mine.fp8_amax_history, whole.fp8_amax_history[rows])
        assert torch.equal(mine.fp8_scale, whole.fp8_scale[rows])
    with pytest.raises(ValueError, match="does not split into ep = 2 ranks of 2 experts"):
        mine.fp8_piece(whole.fp8_scale[:3])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", ["blockwise", "mxfp8", "rowwise"])
def test_grouped_gemm_path_equals_one_fp8_linear_per_group(monkeypatch, name, bf16):
    """Blockwise, MXFP8 and rowwise run all experts as one grouped GEMM per pass; the values
    are those of the per-group path (one FP8 linear per expert): the same quantization, and
    GEMMs that differ at most in FP32 summation order (measured: outputs and weight
    gradients bit for bit, input gradients 7e-10 apart in FP32, equal under BF16)."""
    from hyperloom.engine.fp8 import fp8_grouped_linear
    from hyperloom.engine.fp8.modules import grouped_mm_runs

    assert grouped_mm_runs("cpu", torch.bfloat16) and grouped_mm_runs("cpu", torch.float32)
    calls = []  # probed above, so what is counted below is the layer's own GEMMs
    grouped_mm = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    sizes = [37, 0, 128, 5, 200, 61]  # an idle expert; groups not multiples of 128
    g = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(sum(sizes), 256, generator=g), torch.randn(6, 192, 256, generator=g)
    dy = torch.randn(sum(sizes), 192, generator=g)
    out = []
    for grouped in (True, False):
        x, w = x0.clone().requires_grad_(), (w0 * 0.05).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = fp8_grouped_linear(x, w, sizes, recipe_from_name(name), grouped=grouped)
        y.backward(dy.to(y.dtype))
        out.append((y.float(), x.grad.float(), w.grad.float()))
        if grouped:  # forward and the input gradient, in the autocast dtype
            assert calls == [torch.bfloat16 if bf16 else torch.float32] * 2, calls
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = out
    assert torch.equal(y, y_ref) and torch.equal(dw, dw_ref)
    assert ((dx - dx_ref).norm() / dx_ref.norm()).item() < 1e-7
    assert dw[1].abs().max() == 0  # the idle expert
