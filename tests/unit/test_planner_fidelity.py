"""Planner fidelity on real clusters (issue 34): kernel efficiency by shape, link tiers per
collective, profiles that say where each number comes from, the roofline as a labelled bound,
`plan predict` from flags, the memory table's sums and the job's `model.moe_imbalance`."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hyperloom.config import preset_config
from hyperloom.planner import Cluster, ModelSpec, PlanError, Strategy, predict
from hyperloom.planner.collectives import collective_time, group_link, p2p_link
from hyperloom.planner.hardware import PROFILES, load_profile, roofline
from hyperloom.planner.kernels import AttentionModel, GemmModel, fit_gemm_model
from hyperloom.planner.network import TIERS
from hyperloom.planner.report import MEMORY_PARTS, memory_row
from hyperloom.planner.simulate import with_roofline

H100, B200 = PROFILES["h100"], PROFILES["b200"]
LLAMA8 = ModelSpec.from_model_config(preset_config("llama3-8b"))


# --- GEMMs by shape -------------------------------------------------------------------------


def test_wave_quantization_costs_the_idle_sms_of_the_last_wave():
    """132 SMs, 256x128 tiles: 132 tiles fill one wave; 133 need a second that is 1/132
    full, so the same work per tile runs at about half the rate."""
    g = GemmModel(132, 1.0, k_half=0.0, tiles=((256, 128, 1.0),))
    full = g.efficiency(256 * 132, 128, 8192)
    over = g.efficiency(256 * 133, 128, 8192)
    assert full == pytest.approx(1.0)
    assert over == pytest.approx(133 / 264)


def test_tile_quantization_and_split_k_and_small_k():
    g = GemmModel(132, 1.0, k_half=64.0, tiles=((128, 128, 1.0),))
    n = 128 * 132  # one wave of 132 tiles at m = 128
    # 129 rows pad to 256: 2 waves of tiles of which half the rows are padding
    exact, padded = g.shape_factor(128, n, 4096), g.shape_factor(129, n, 4096)
    assert exact == pytest.approx(1.0)
    assert padded == pytest.approx(129 / 256)
    # a short K runs below the machine's rate: k / (k + k_half), relative to K = 2048
    ref = 2048 / 2112
    assert g.shape_factor(128, n, 64) == pytest.approx(0.5 / ref)
    assert g.shape_factor(128, n, 1024) == pytest.approx(1024 / 1088 / ref)
    assert g.shape_factor(128, n, 8192) == 1.0  # no gain past the published best shapes' K
    # fewer tiles than SMs: split-K fills them, better than one mostly idle wave
    assert g.shape_factor(128, 128, 8192) > 5 / 132


@pytest.mark.parametrize(
    ("name", "shape"),
    [("h100", (6144, 17920, 2816)), ("mi300x", (4096, 10240, 4864))],
)
def test_profiles_reproduce_the_published_mamf_at_its_shape(name, shape):
    acc = PROFILES[name]
    assert acc.gemm_efficiency(*shape) == pytest.approx(acc.gemm_eff, rel=1e-9)
    # a tensor-parallel slice of a 70B layer (n = 1280) runs below it, a tiny GEMM far below
    assert acc.gemm_efficiency(8192, 1280, 8192) < acc.gemm_eff
    assert acc.gemm_efficiency(128, 128, 128) < 0.1


def test_a100_sxm_kernels_are_the_measured_pcie_parts_uncapped():
    """The A100 SXM's GEMM and attention models are the A100 PCIe's, fitted to its measured
    shapes, over the MAMF ratio of the two parts (256.4 / 267.9): at Llama 2 13B's FFN shape
    0.79 of peak, where the model anchored on MAMF's best shape (0.859) gave 0.85."""
    sxm, pcie, ratio = PROFILES["a100"], PROFILES["a100-pcie"], 256.4 / 267.9
    assert sxm.gemm_model.peak_eff == pytest.approx(pcie.gemm_model.peak_eff / ratio)
    assert sxm.gemm_model.k_half == pcie.gemm_model.k_half
    assert sxm.attn_model.fwd_max == pytest.approx(pcie.attn_model.fwd_max / ratio)
    assert sxm.attn_model.bwd_max == pytest.approx(pcie.attn_model.bwd_max / ratio)
    assert sxm.gemm_efficiency(8192, 13824, 5120) == pytest.approx(0.792, abs=1e-3)
    assert not sxm.linear_table  # the PCIe part's tables are not carried over


def test_backward_forms_run_at_their_own_shapes():
    """A skinny forward (m x 128) is a different GEMM backward: the weight gradient's output
    is 128 x k and its inner dimension m."""
    f, b, w = H100.gemm_times(16384, 512, 16384)
    assert f == pytest.approx(H100.gemm_time(16384, 512, 16384))
    assert b == pytest.approx(H100.gemm_time(16384, 16384, 512))
    assert w == pytest.approx(H100.gemm_time(512, 16384, 16384))
    assert b > 1.05 * f  # the data gradient's inner dimension is the short 512
    flat = dataclasses.replace(H100, gemm_model=None)
    assert flat.gemm_times(16384, 512, 16384) == (flat.gemm_time(16384, 512, 16384),) * 3


def test_fit_recovers_a_known_gemm_model():
    truth = GemmModel(108, 0.83, k_half=181.0)
    shapes = [(m, n, k) for m in (512, 4096, 16384) for n in (1024, 5120) for k in (256, 4096)]
    samples = [(s, truth.efficiency(*s)) for s in shapes]
    fitted = fit_gemm_model(GemmModel(108, 1.0), samples)
    assert fitted.k_half == pytest.approx(181.0, rel=0.1)
    assert fitted.peak_eff == pytest.approx(0.83, rel=0.02)
    assert max(abs(fitted.efficiency(*s) / e - 1) for s, e in samples) < 0.02
    with pytest.raises(PlanError):
        fit_gemm_model(GemmModel(108, 1.0), [])


def test_attention_by_length_and_head_dim():
    a = AttentionModel(0.7, 0.5, seq_half=512.0)
    assert a.efficiency(512) == pytest.approx(0.35)
    assert a.efficiency(1 << 20) == pytest.approx(0.7, rel=1e-3)
    assert a.efficiency(8192, backward=True) == pytest.approx(0.5 * 8192 / 8704)
    assert a.efficiency(8192, head_dim=64) < a.efficiency(8192, head_dim=128)
    assert a.efficiency(8192, head_dim=192) == a.efficiency(8192, head_dim=128)
    # the in-step anchors: forward + backward (1 + 2.5 the FLOPs) at 8K tokens. H100's model
    # is set from it; B200's is fitted to SimuMax's kernel measurements (`measured_b200`) and
    # meets the study's FlashAttention-4 figure for Llama-3.1-8B (32 heads) independently.
    for acc, published, rows, tol in ((H100, 0.45, 0.0, 0.01), (B200, 0.37, 8192 * 32, 0.02)):
        m = acc.attn_model
        f, b = (m.efficiency(8192, 128, bwd, rows) for bwd in (False, True))
        assert 3.5 / (1 / f + 2.5 / b) == pytest.approx(published, abs=tol)


# --- link tiers ------------------------------------------------------------------------------


# the a priori PCIe tier (the built-in a100-pcie profile now takes the measured pcie-a100)
PRIOR_PCIE = dataclasses.replace(PROFILES["a100-pcie"], intra_tier="pcie", intra_eff=0.68)


def test_pcie_groups_lose_bandwidth_as_they_grow_and_tp_over_pcie_is_expensive():
    cl = Cluster(PRIOR_PCIE, 8, 8)
    two, eight = group_link(cl, 2, 1), group_link(cl, 8, 1)
    assert two.bandwidth == pytest.approx(31.5e9 * 0.68)
    assert eight.bandwidth == pytest.approx(31.5e9 * 0.68 * 0.8**2)
    nv = group_link(Cluster(PROFILES["a100"], 8, 8), 8, 1)
    assert nv.bandwidth > 15 * eight.bandwidth
    s = Strategy(tp=8, mbs=1, microbatches=8, recompute="full")
    fast = predict(LLAMA8, Cluster(PROFILES["a100"], 8, 8), s, 4096, "megatron")
    slow = predict(LLAMA8, Cluster(PROFILES["a100-pcie"], 8, 8), s, 4096, "megatron")
    assert fast.breakdown["tp_comm"] < 0.1 * fast.step_time
    assert slow.breakdown["tp_comm"] > 0.5 * slow.step_time
    assert slow.step_time > 4 * fast.step_time


def test_each_collective_gets_its_tier_factor_and_latency():
    cl = Cluster(H100, 64, 8)
    link = group_link(cl, 8, 1)
    size = 1e9
    ring = 7 / 8 * size / link.bandwidth
    assert collective_time("all_gather", 8, size, link) == pytest.approx(ring + 7 * 1.5e-6)
    a2a = collective_time("all_to_all", 8, size, link)
    assert a2a == pytest.approx(ring / TIERS["nvlink"].efficiency("all_to_all") + 7 * 1.5e-6)
    pcie = group_link(Cluster(PRIOR_PCIE, 8, 8), 4, 1)
    assert collective_time("all_reduce", 4, 8.0, pcie) == pytest.approx(2 * 3 * 8e-6, rel=1e-3)


def test_stragglers_slow_collectives_that_span_more_nodes():
    small, big = Cluster(H100, 16, 8), Cluster(H100, 1024, 8)
    a, b = group_link(small, 2, 8), group_link(big, 128, 8)  # one member per node
    assert (a.slow, b.slow) == (pytest.approx(1.02), pytest.approx(1 + 0.02 * 7))
    assert group_link(small, 8, 1).slow == 1.0  # inside a node
    assert p2p_link(big, 2, 512).level == "inter"


# --- profiles --------------------------------------------------------------------------------


def test_every_profile_says_where_its_numbers_come_from():
    assert set(PROFILES) >= {"a100", "a100-pcie", "h100", "h200", "b200", "mi300x", "mtt-s4000"}
    for name, acc in PROFILES.items():
        fields = {k for k, _ in acc.sources}
        assert {"bf16_tflops", "hbm_gbs", "gemm_model", "attn_model"} <= fields, name
        assert acc.gemm_model is not None and acc.attn_model is not None, name
        assert acc.intra_tier in TIERS and acc.inter_tier in TIERS, name
        assert acc.source_of("gemm_model") != acc.source
    assert "nccl-tests#175" in PROFILES["a100"].source_of("intra_eff")
    assert "SimuMax" in B200.source_of("gemm_model") and "1745" in B200.source_of("gemm_eff")


def test_profiles_with_models_roundtrip_through_json(tmp_path):
    from hyperloom.planner.hardware import save_profile

    for acc in PROFILES.values():
        assert load_profile(save_profile(acc, tmp_path / f"{acc.name}.json")) == acc
    body = json.loads((tmp_path / "b200.json").read_text())["accelerator"]
    body["gemm_model"]["sms"] = "many"
    (tmp_path / "bad.json").write_text(json.dumps({"accelerator": body}))
    with pytest.raises(PlanError, match="gemm_model"):
        load_profile(tmp_path / "bad.json")


def test_the_roofline_is_a_bound_on_every_profile():
    s = Strategy(tp=2, pp=2, dp=2, zero=1, mbs=1, microbatches=8, recompute="selective")
    for name in ("a100", "a100-pcie", "h100", "b200", "mi300x"):
        plan = with_roofline(predict(LLAMA8, Cluster.of(name, 8), s, 4096, "megatron"))
        assert plan.roofline_step_time < plan.step_time, name
        assert plan.roofline_mfu > plan.mfu
        assert plan.to_dict()["roofline_mfu"] == plan.roofline_mfu
    bare = roofline(B200)
    assert (bare.gemm_model, bare.attn_model, bare.intra_tier) == (GemmModel.ideal(), None, "")
    assert bare.gemm_efficiency(8192, 1280, 8192) == 1.0 == bare.mem_eff


# --- report, job, CLI ------------------------------------------------------------------------


def test_memory_table_parts_sum_to_the_activation_peak():
    s = Strategy(tp=2, pp=2, dp=2, zero=1, mbs=1, microbatches=8)
    for rt in ("hyperloom", "megatron"):
        plan = predict(LLAMA8, Cluster.of("h100", 8), s, 4096, rt)
        for mem in plan.memory:
            row = memory_row(mem)
            parts, act, step, peak = row[: len(MEMORY_PARTS)], *row[len(MEMORY_PARTS) : -1]
            assert sum(parts) == pytest.approx(act)
            assert peak == pytest.approx(max(act, step))
    # a peak at the update (ZeRO-0 states of a large model, tiny activations)
    big = ModelSpec.from_model_config(preset_config("llama3-70b"))
    plan = predict(big, Cluster.of("b200", 8), Strategy(pp=8, mbs=1, microbatches=8), 256)
    mem = plan.memory[0]
    assert memory_row(mem)[-2] == pytest.approx(max(mem.activation_peak, mem.step_peak))


def test_moe_imbalance_from_the_job_and_its_check():
    from hyperloom.planner.cli import load_job

    job = load_job(None, ["--model.preset", "deepseek-v2-lite", "--model.moe_imbalance", "1.5"])
    assert ModelSpec.from_job(job).moe_imbalance == 1.5
    assert ModelSpec.from_model_config(job.model).moe_imbalance == 1.5
    bad = load_job(None, ["--model.preset", "deepseek-v2-lite", "--model.moe_imbalance", "0.5"])
    assert any("moe_imbalance must be >= 1" in p for p in bad.model.family_problems(bad))


def _predict_json(tmp_path, *argv):
    from hyperloom.cli import main

    out = tmp_path / "p.json"
    assert main(["plan", "predict", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_plan_predict_from_flags_equals_the_same_job_as_overrides(tmp_path):
    flags = _predict_json(
        tmp_path,
        *"--model llama3-8b --layers 8 --tp 2 --pp 2 --dp 2 --mbs 1 --microbatches 8".split(),
        *"--seq 2048 --recompute full --accelerator a100 --moe-imbalance 1.0".split(),
    )
    plan = flags["plans"][0]
    s = plan["strategy"]
    assert (s["tp"], s["pp"], s["dp"], s["microbatches"], s["recompute"]) == (2, 2, 2, 8, "full")
    assert flags["query"]["gpus"] == 8 and flags["query"]["seq"] == 2048
    assert 0 < plan["roofline_step_time_s"] < plan["step_time_s"]
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        '[model]\npreset = "llama3-8b"\nn_layers = 8\n[parallel]\ntp = 2\npp = 2\ndp = 2\n'
        "microbatches = 8\n[train]\nmicro_batch_size = 1\n[data]\nseq_len = 2048\n"
    )
    toml = _predict_json(tmp_path, str(cfg), "--recompute", "full", "--accelerator", "a100")
    assert toml["plans"][0]["step_time_s"] == pytest.approx(plan["step_time_s"], rel=1e-12)
    # a custom shape and the global batch; every layer of the shape is the flags'
    custom = _predict_json(
        tmp_path,
        *"--dim 2048 --layers 4 --heads 16 --kv-heads 4 --ffn 8192 --vocab 32000".split(),
        *"--tp 2 --dp 4 --mbs 1 --global-batch 32 --seq 1024 --accelerator a100-pcie".split(),
    )
    s = custom["plans"][0]["strategy"]
    assert (s["dp"], s["mbs"], s["microbatches"]) == (4, 1, 8)
    assert custom["query"]["accelerator"] == "a100-pcie"


def test_plan_predict_flag_errors_are_one_line(tmp_path, capsys):
    from hyperloom.cli import main

    cases = [
        (["plan", "predict", "--tp", "2"], "needs a job CONFIG or the model as flags"),
        (["plan", "predict", "--model", "llama3-8b", "--dp", "3", "--global-batch", "8"],
         "not a multiple of dp (3)"),
        (["plan", "predict", "--model", "nope"], "nope"),
        (["plan", "predict", "--model", "llama3-8b", "--heads", "7"], "heads"),
    ]  # fmt: skip
    for argv, text in cases:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's and the CLI's own exits
            code = exc.code
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert text in err and "Traceback" not in err, (argv, err)


def test_calibration_times_the_jobs_own_gemm_forms_and_fits_the_model():
    from hyperloom.accelerator import get_accelerator
    from hyperloom.planner import calibrate_gemm as cg
    from hyperloom.planner.cli import load_job

    job = load_job(None, "--model.preset tiny --parallel.tp 2 --data.seq_len 64".split())
    shapes = cg.job_gemm_shapes(job)
    spec = ModelSpec.from_job(job)
    tokens = job.train.micro_batch_size * 64
    head = (tokens, spec.vocab_size // 2, spec.dim)
    assert head in shapes and (head[0], head[2], head[1]) in shapes  # its data gradient
    assert len(shapes) == len(set(shapes)) >= 9
    cpu = get_accelerator("cpu")
    measured = cg.measure_matmuls(cpu, __import__("torch").float32, shapes[:3], runs=1)
    assert all(t > 0 for _, t in measured)
    # a device with SMs: the table takes the measurements, the model is fitted to them
    truth = GemmModel(108, 0.8, k_half=128.0)
    synthetic = [(s, 300.0 * truth.efficiency(*s)) for s in shapes]
    base = dataclasses.replace(PROFILES["a100"], gemm_table=())
    fitted = cg.with_job_gemms(base, synthetic, 108)
    assert dict(fitted.gemm_table)[shapes[0]] == pytest.approx(synthetic[0][1] / 312.0)
    assert fitted.gemm_model.peak_eff * 312 == pytest.approx(0.8 * 300, rel=0.05)
    assert math.isclose(fitted.gemm_efficiency(*shapes[1]), synthetic[1][1] / 312.0)
    cpu_profile = cg.with_job_gemms(base, synthetic, 0)
    assert cpu_profile.gemm_model is None and len(cpu_profile.gemm_table) == len(shapes)


def test_a_hardware_profile_with_unknown_tier_is_an_error():
    bad = dataclasses.replace(H100, intra_tier="carrier-pigeon")
    with pytest.raises(PlanError, match="unknown network tier"):
        group_link(Cluster(bad, 8, 8), 8, 1)
