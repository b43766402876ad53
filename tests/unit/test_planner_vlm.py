"""The planner on vision-language models (family vlm): the encoder and projector on the first
pipeline stage, their FLOPs against `models.vlm.accounting`, frozen parts, tensor parallelism."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hyperloom.config import preset_config
from hyperloom.models.vlm import accounting
from hyperloom.planner import Cluster, ModelSpec, SearchSpace, Strategy, predict, search
from hyperloom.planner.costs import layer_phase
from hyperloom.planner.model import build_vision_block
from hyperloom.planner.simulate import _layer, effective_profile, memory_per_rank, prepare
from hyperloom.planner.strategy import RUNTIMES, check
from hyperloom.planner.vision import tower_forward_flops, tower_memory, tower_phase

LLAVA = preset_config("llava-1.5-7b")
SEQ = 2048
RT = RUNTIMES["hyperloom"]
A100 = Cluster.of("a100", 8)
# tp 2, pp 2, dp 2: the first stage holds the encoder, the second does not
LAYOUT = Strategy(tp=2, pp=2, dp=2, mbs=1, microbatches=8, zero=1)


def _spec(**changes) -> ModelSpec:
    return ModelSpec(LLAVA, "llava-1.5-7b", **changes)


def _llama() -> ModelSpec:
    """The same decoder as a plain llama job."""
    return ModelSpec(dataclasses.replace(LLAVA, family="llama"), "llama-2-7b")


VARIANTS = {
    "llava-1.5": {},
    "linear-projector": {"projector": "linear", "projector_bias": False},
    "pixel-shuffle": {"pixel_shuffle": 2},
    "siglip": {
        "vision_class_token": False,
        "vision_pre_norm": False,
        "vision_patch_bias": True,
        "vision_act": "gelu_tanh",
    },
    "class-token-kept": {"vision_feature_select": "full", "vision_feature_layer": -1},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_encoder_flops_and_params_equal_the_accounting(variant):
    cfg = dataclasses.replace(LLAVA, **VARIANTS[variant])
    spec = ModelSpec.from_model_config(cfg)
    per_image = accounting.vision_training_flops_per_image(cfg)
    # the costed GEMMs and attention of one image, forward, three times for training
    assert 3 * tower_forward_flops(spec, 1.0) == per_image
    assert spec.vision_flops_per_image() == per_image
    assert spec.params() == accounting.param_count(cfg)
    for seq in (576, 2048, 4096):
        want = accounting.training_flops_per_token(cfg, seq)
        assert spec.model_flops_per_token(seq) == pytest.approx(want, abs=1.0)


def test_a_deepseek_decoder_is_costed_as_its_family():
    cfg = dataclasses.replace(
        preset_config("moe-tiny"),
        family="vlm",
        vlm_decoder="deepseek",
        image_size=64,
        patch_size=16,
        vision_dim=64,
        vision_layers=3,
        vision_heads=4,
        vision_ffn_dim=128,
        image_token_id=0,
    )
    spec = ModelSpec.from_model_config(cfg)
    assert spec.mla and spec.n_routed_experts and spec.decoder_family == "deepseek"
    assert spec.params() == accounting.param_count(cfg)
    assert spec.model_flops_per_token(256) == pytest.approx(
        accounting.training_flops_per_token(cfg, 256), abs=1.0
    )
    plan = predict(spec, Cluster.of("h100", 4), Strategy(pp=2, dp=2, ep=2, microbatches=4), 256)
    assert 0 < plan.mfu < 1


def test_the_first_stage_carries_the_encoder():
    vlm, llama = _spec(), _llama()
    a, b = prepare(vlm, A100, LAYOUT, SEQ, RT), prepare(llama, A100, LAYOUT, SEQ, RT)
    key = dataclasses.replace(LAYOUT, schedule="1f1b", vpp=1, microbatches=1)
    acc = effective_profile(A100, RT)
    links = _layer(vlm, A100, RT, SEQ, key)[4]
    tower = tower_phase(vlm, key, SEQ, acc, links, RT)
    assert tower.f > 0 and tower.b > 0 and tower.w > 0
    # time: the first chunk's F, B, W exceed the llama job's by the tower's; the rest equal
    assert a.f[0] - b.f[0] == pytest.approx(tower.f)
    assert a.b[0] - b.b[0] == pytest.approx(tower.b)
    assert a.w[0] - b.w[0] == pytest.approx(tower.w)
    assert list(a.f[1:]) == list(b.f[1:]) and list(a.b[1:]) == list(b.b[1:])
    assert list(a.w[1:]) == list(b.w[1:])
    pa, pb = predict(vlm, A100, LAYOUT, SEQ, RT), predict(llama, A100, LAYOUT, SEQ, RT)
    m = LAYOUT.microbatches
    extra = pa.rank_breakdown[0]["compute"] - pb.rank_breakdown[0]["compute"]
    assert extra == pytest.approx(m * tower.compute)
    assert pa.rank_breakdown[1]["compute"] == pytest.approx(pb.rank_breakdown[1]["compute"])
    assert pa.step_time > pb.step_time
    # memory: the first rank's states grow by the encoder's and projector's parameters
    # (trainable ones with gradients and optimizer state), its activations by the tower's
    # saved bytes per micro-batch in flight; the second rank's memory is unchanged
    ma, mb = pa.memory, pb.memory
    total, frozen = vlm.vision_params(LAYOUT.tp)
    trainable = total - frozen
    assert ma[0].params - mb[0].params == pytest.approx(4 * total)
    assert ma[0].grads - mb[0].grads == pytest.approx(4 * trainable)
    # ZeRO-1 over dp 2: the FP32 moments and master slice (12 B) sharded
    assert ma[0].optimizer - mb[0].optimizer == pytest.approx(12 * trainable / 2)
    in_flight = a.structure()[1][0]
    saved = tower_memory(vlm, key, RT, fp8_saved=False).saved
    assert saved > 0
    assert ma[0].activations - mb[0].activations == pytest.approx(in_flight * saved)
    assert ma[1].to_dict() == mb[1].to_dict()


def test_the_encoder_block_is_non_causal_over_each_image():
    spec = _spec()
    n, d = spec.vision_positions, spec.vision_dim
    one = build_vision_block(spec, 1.0, 1)
    two = build_vision_block(spec, 2.0, 2)
    assert one.attn_flops == 4.0 * n * n * d  # q kᵀ and p v, the full square
    assert two.attn_flops == one.attn_flops  # twice the images over half the heads
    assert two.gemm_flops == one.gemm_flops


def _rank0(spec: ModelSpec, s: Strategy):
    prep = prepare(spec, A100, s, SEQ, RT)
    return prep, memory_per_rank(spec, s, SEQ, RT, prep, (0,))[0]


def test_a_frozen_encoder_saves_its_gradients_optimizer_state_and_backward():
    s = dataclasses.replace(LAYOUT, zero=0)
    live, m_live = _rank0(_spec(), s)
    cold, m_cold = _rank0(_spec(freeze=("vision",)), s)
    spec = _spec()
    d, t = spec.vision_dim, s.tp
    running = spec.vision_embed_params() - 2 * d + spec.vision_depth * spec.vision_block_params(t)
    # FP32 weights stay; FP32 gradients (4 B) and Adam's two moments (8 B) go
    assert m_cold.params == pytest.approx(m_live.params)
    assert m_live.grads - m_cold.grads == pytest.approx(4 * running)
    assert m_live.optimizer - m_cold.optimizer == pytest.approx(8 * running)
    assert m_cold.activations < m_live.activations
    # time: the same forward; B and W of the first chunk lose the encoder's backward, at
    # least its blocks' (the projector still runs its own)
    assert list(cold.f) == list(live.f)
    assert list(cold.b[1:]) == list(live.b[1:]) and list(cold.w[1:]) == list(live.w[1:])
    key = dataclasses.replace(s, sp=False, schedule="1f1b", vpp=1, microbatches=1)
    acc = effective_profile(A100, RT)
    block = build_vision_block(spec, s.mbs, t)
    bw = layer_phase(block, spec, key, acc, live.links, RT)
    saved = (live.b[0] + live.w[0]) - (cold.b[0] + cold.w[0])
    assert saved > spec.vision_depth * (bw.b + bw.w)
    cold_tower = tower_phase(_spec(freeze=("vision",)), key, SEQ, acc, live.links, RT)
    assert 0 < cold_tower.b + cold_tower.w < 0.05 * saved  # the projector's backward
    p_live = predict(_spec(), A100, s, SEQ, RT)
    p_cold = predict(_spec(freeze=("vision",)), A100, s, SEQ, RT)
    assert p_cold.step_time < p_live.step_time
    # the model FLOPs count the frozen encoder's backward all the same (the accounting's
    # convention), so the shorter step reads as a higher MFU
    assert p_cold.mfu > p_live.mfu


def test_projector_alignment_freezes_encoder_and_decoder():
    """LLaVA's first stage: only the projector trains; the decoder passes input gradients
    back to it but forms no weight gradients and holds no optimizer state."""
    s = dataclasses.replace(LAYOUT, zero=0)
    spec = _spec(freeze=("vision", "decoder"))
    plan = predict(spec, A100, s, SEQ, RT)
    prep = prepare(spec, A100, s, SEQ, RT)
    projector = spec.projector_params(s.tp)
    assert plan.memory[0].grads == pytest.approx(4 * projector)
    assert plan.memory[1].grads == 0 and plan.memory[1].optimizer == 0
    assert prep.w[1] == 0 and prep.b[1] > 0
    assert plan.step_time < predict(_spec(), A100, s, SEQ, RT).step_time
    with pytest.raises(ValueError, match="freezes every parameter"):
        _spec(freeze=("vision", "projector", "decoder"))


def test_globs_freeze_whole_parts_only():
    assert _spec(freeze=("vision.*",)).frozen("vision")
    assert _spec(freeze=("projector.*",)).frozen("projector")
    assert not _spec(freeze=("vision.layers.*",)).frozen("vision")  # a share: trainable


def test_tensor_parallelism_halves_the_encoders_weights_per_rank():
    spec = _spec()
    one, two = spec.vision_params(1)[0], spec.vision_params(2)[0]
    assert 0.5 < two / one < 0.505  # LayerNorms, embeddings, row biases stay whole
    # split: every block's matrices and its q, k, v and fc1 biases; the projector's
    # matrices and linear_1's bias
    d, f, h = spec.vision_dim, spec.vision_ffn_dim, spec.dim
    split = spec.vision_layers * (spec.vision_block_matmul() + 3 * d + f)
    split += spec.projector_in * h + h + h * h
    assert two == pytest.approx(one - split / 2)
    # the first rank's weight bytes beyond the llama job's, at tp 1 and tp 2
    grow = {}
    for tp in (1, 2):
        s = Strategy(tp=tp, pp=2, dp=4 // tp, mbs=1, microbatches=8)
        grow[tp] = (
            predict(spec, A100, s, SEQ, RT).memory[0].params
            - predict(_llama(), A100, s, SEQ, RT).memory[0].params
        )
    assert grow[2] / grow[1] == pytest.approx(0.5, rel=0.01)
    # and the encoder blocks' GEMM FLOPs per rank halve
    block1, block2 = build_vision_block(spec, 1.0, 1), build_vision_block(spec, 1.0, 2)
    assert block2.gemm_flops == block1.gemm_flops / 2


def test_check_names_what_a_vlm_cannot_run():
    spec = _spec()
    assert "cp" in check(Strategy(cp=2), spec, SEQ)
    assert "vision_heads" in check(Strategy(tp=32), spec, SEQ)
    assert "seq" in check(Strategy(), _spec(images_per_sample=4), SEQ)
    assert check(Strategy(tp=8), spec, SEQ) is None


def test_more_images_per_sample_cost_more():
    one = predict(_spec(), A100, LAYOUT, SEQ, RT)
    two = predict(_spec(images_per_sample=2), A100, LAYOUT, SEQ, RT)
    assert two.step_time > one.step_time
    assert two.memory[0].activations > one.memory[0].activations
    assert two.memory[1].to_dict() == one.memory[1].to_dict()


def test_search_plans_llava_and_mfu_is_the_accounting_flops():
    spec = _spec()
    space = SearchSpace().fixed(fp8=False, zero=(0, 1), recompute=("none", "selective"))
    result = search(spec, A100, 32, SEQ, RT, space, top_k=3)
    assert result.top
    for plan in result.top:
        s = plan.strategy
        assert s.cp == 1
        flops = accounting.training_flops_per_token(LLAVA, SEQ) * s.global_batch * SEQ
        peak = A100.gpus * A100.profile.bf16_tflops * 1e12
        assert plan.mfu == pytest.approx(flops / (plan.step_time * peak), rel=1e-9)
    assert result.rejected  # cp > 1 among them


def test_cli_plans_a_llava_job_with_its_frozen_parts(tmp_path):
    from hyperloom.cli import main

    job = tmp_path / "llava.toml"
    job.write_text(
        '[model]\npreset = "llava-1.5-7b"\n[data]\nsource = "scenes"\nseq_len = 2048\n'
        "[parallel]\ntp = 2\npp = 2\ndp = 2\n[train]\nmicro_batch_size = 1\n"
        'freeze = ["vision"]\n'
    )
    out = tmp_path / "plan.json"
    assert main(["plan", str(job), "--accelerator", "a100", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["query"]["freeze"] == ["vision"]
    assert record["plans"][0]["model"] == "llava-1.5-7b"
    searched = tmp_path / "search.json"
    argv = ["plan", "search", "--model", "llava-1.5-7b", "--gpus", "8", "--accelerator", "a100"]
    argv += ["--global-batch", "16", "--seq", "2048", "--top", "2", "--freeze", "vision"]
    argv += ["--fix", "fp8=false,zero=1", "--json", str(searched)]
    assert main(argv) == 0
    assert json.loads(searched.read_text())["plans"]
