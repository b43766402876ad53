"""The built-in accelerator profiles, each number with where it comes from.

Peaks are dense (2:4-sparsity headlines halved) from the vendors' datasheets; memory is what
the device reports, in GiB; links are per GPU and per direction. The efficiencies:

- GEMMs (`kernels.GemmModel`): the SM count from the datasheet, ``peak_eff`` derived so the
  model reproduces the published maximum achievable matmul FLOPS (MAMF, stas00/ml-engineering
  "Maximum Achievable Matmul FLOPS comparison table") at the shape where it was measured;
  ``gemm_eff`` keeps that MAMF over the peak. FP8 GEMMs at the published FP8 over BF16 MAMF
  ratio where there is one. B200 and A100 PCIe: public per-shape measurements (SimuMax's
  system files: `measured_b200`, `measured_a100_pcie`) as tables, the models fitted to them;
  A100 SXM: the PCIe part's fits over the MAMF ratio of the two (MAMF is a best shape).
- Attention (`kernels.AttentionModel`): measured per shape on B200 and A100 PCIe (the SXM
  part from the PCIe fit, as its GEMMs); H100/H200 from the in-step
  decomposition of a Llama-3.1-8B training step at 8K tokens in stas00/ml-engineering's
  H200-to-B200 upgrade study (FlashAttention-3 447 TFLOP/s forward + backward on H200, 45%;
  FlashAttention-4 834 on B200, 37%), split forward/backward as FlashAttention-3 (arXiv
  2407.08608) reports the backward below the forward.
- Memory: ``mem_eff`` a coalesced stream's share of the HBM peak (2.8 of 3.35 TB/s, 84%,
  measured with Nsight Compute on H100 SXM5: mikamirai.com/blog/gpu-memory-bandwidth; ECC on),
  ``elementwise_eff`` 0.8 of that for the fused training kernels (norms, SwiGLU, RoPE, adds),
  assumed.
- A training step's share of its kernels' isolated speed (``step_eff``: clocks under
  sustained power, SMs shared with overlapped collectives, gaps between kernels): 0.816 on
  H100, the factor that fits Megatron-LM's published H100 weak-scaling table (its README,
  the planner's validation 1; `published.fit_efficiency` on the five fit rows), assumed for
  H200, MI300X and MTT S4000; 1 on B200, whose kernels are measured at the job's shapes
  (`measured_b200`), and on A100, whose published Megatron runs (Korthikanti et
  al. 2022, validation 2) the kernel model reproduces without one.
- Links (`network.py`): all-reduce bus bandwidth from nccl-tests reports (8 A100 SXM
  232.5 GB/s of 300, NVIDIA/nccl-tests#175; NCCL's ~24 GB/s per 200 Gb/s NIC,
  NVIDIA/nccl-tests#119; PCIe from NVIDIA/nccl#1639), the tiers' per-collective factors;
  B200's NVLink5 per collective and A100 PCIe's per collective and group size from SimuMax's
  nccl-tests fits (`measured_b200.NCCL_FIT`, `measured_a100_pcie.NCCL_FIT`).
- B200 only: a fixed 30 us per call of a memory-bound module (`launches.py`), SimuMax's
  default for B200, a prior.

`HardwareProfile.sources` repeats these per field; `hyperloom plan calibrate` replaces them
with measurements (docs/planner.md, "Profiles").
"""

from __future__ import annotations

from hyperloom.planner import measured_a100_pcie as MA100P
from hyperloom.planner import measured_b200 as MB200
from hyperloom.planner.hardware import HardwareProfile
from hyperloom.planner.kernels import AttentionModel, GemmModel, derive_peak_eff

MAMF = "stas00/ml-engineering MAMF table"
STEP_8K = "stas00/ml-engineering H200->B200 study, Llama-3.1-8B step at 8K"
MEM = "84% of HBM3 peak for coalesced streams on H100 SXM5 (mikamirai.com, Nsight Compute)"
ELEM_EFF = 0.93
ELEM = "0.93 of a stream for the fused training kernels: 78% of peak for MLP-weight streams against 84% coalesced (same source)"
# fitted on Megatron-LM's H100 table (module docstring); the A100 runs need none
STEP_EFF_H100 = 0.816
STEP = "0.816: fits Megatron-LM's H100 weak-scaling table (README; planner validation 1)"
NIC_EFF = "NCCL ~24 of 25 GB/s per 200 Gb/s NIC (NVIDIA/nccl-tests#119)"
NVLINK_EFF = "8 A100 SXM all-reduce 232.5 of 300 GB/s (NVIDIA/nccl-tests#175)"


def _attn(fwd: float, bwd: float, seq_half: float, source: str) -> AttentionModel:
    return AttentionModel(fwd, bwd, seq_half, source=source)


def _gemm(sms: int, mamf_eff: float, shape: tuple[int, int, int], source: str) -> GemmModel:
    return GemmModel(sms, derive_peak_eff(sms, mamf_eff, shape), source=source)


# A100 PCIe's kernels: the public per-shape measurements of `measured_a100_pcie` (one A100
# PCIe), and the GEMM and attention models fitted to them (the constants are the fits'
# result, checked by tests/unit/test_planner_a100_pcie.py) for the shapes they lack.
_PCIE_RATIO = 256.4 / 267.9  # its MAMF over the SXM part's: the power cap's cost
_A100_PCIE_GEMM = GemmModel(108, 0.75812, 152.219, source=f"fitted to {MA100P.SOURCE}")
_A100_PCIE_ATTN = AttentionModel(
    0.63343, 0.45415, 0.0, source=f"fitted to {MA100P.SOURCE}", fwd_rows_half=23170.48,
    bwd_rows_half=5792.62,
)  # fmt: skip

# A100 SXM4 80GB: 108 SMs, 312 TF BF16, HBM2e 2.039 TB/s, NVLink3 600 GB/s both ways,
# DGX A100: 8x ConnectX-6 HDR 200 Gb/s. Kernels: the same GA100 as the PCIe part, whose
# kernels are measured per shape, uncapped: its fitted models over the MAMF ratio of the two
# parts (the 300 W cap costs the PCIe part 4.3% on GEMMs; attention assumed alike). MAMF's
# own 0.859 is the best shape its search found, which the measured shapes of real layers do
# not reach (0.78-0.79 at Llama 2 13B's, where the MAMF-anchored model gave 0.85).
_A100_SXM = f"{MA100P.SOURCE}, fitted, over the MAMF ratio 256.4 / 267.9 ({MAMF})"
_A100_GEMM = GemmModel(
    108, _A100_PCIE_GEMM.peak_eff / _PCIE_RATIO, _A100_PCIE_GEMM.k_half, source=_A100_SXM
)
_A100_ATTN = AttentionModel(
    _A100_PCIE_ATTN.fwd_max / _PCIE_RATIO, _A100_PCIE_ATTN.bwd_max / _PCIE_RATIO, 0.0,
    source=_A100_SXM, fwd_rows_half=_A100_PCIE_ATTN.fwd_rows_half,
    bwd_rows_half=_A100_PCIE_ATTN.bwd_rows_half,
)  # fmt: skip
A100 = HardwareProfile(
    "a100",
    312.0,
    0.0,
    80.0,
    2039,
    267.9 / 312.0,
    fp8_speedup=1.0,
    attn_fwd_eff=0.73 * 4096 / (4096 + 256),
    attn_bwd_eff=0.62 * 4096 / (4096 + 256),
    mem_eff=0.84,
    intra_gbs=300.0,
    intra_eff=232.5 / 300,
    nic_gbs=25.0,
    inter_eff=0.96,
    elementwise_eff=ELEM_EFF,
    gemm_model=_A100_GEMM,
    attn_model=_A100_ATTN,
    intra_tier="nvlink",
    inter_tier="ib",
    source="NVIDIA A100 datasheet; efficiencies: see `sources`",
    sources=(
        ("bf16_tflops", "NVIDIA A100 datasheet: 312 TF dense BF16, no FP8"),
        ("hbm_gbs", "NVIDIA A100 80GB SXM datasheet: 2,039 GB/s"),
        ("gemm_model", _A100_GEMM.source + "; 108 SMs"),
        ("attn_model", _A100_ATTN.source),
        ("mem_eff", MEM + "; assumed alike"),
        ("elementwise_eff", ELEM),
        ("intra_eff", NVLINK_EFF),
        ("nic_gbs", "DGX A100: one HDR 200 Gb/s NIC per GPU"),
        ("inter_eff", NIC_EFF),
        ("step_eff", "1: Korthikanti et al. 2022's A100 times reproduced without one"),
    ),
)

# A100 PCIe 80GB: the same GA100 at 300 W, HBM2e 1.935 TB/s, no NVLink bridge assumed: GPUs
# talk over PCIe Gen4 x16 (16 GT/s x 16 lanes x 128/130 / 8 = 31.5 GB/s a direction).
# Kernels: `measured_a100_pcie`'s tables and the models fitted to them (above).
A100_PCIE = HardwareProfile(
    "a100-pcie",
    312.0,
    0.0,
    80.0,
    1935,
    256.4 / 312.0,
    fp8_speedup=1.0,
    attn_fwd_eff=A100.attn_fwd_eff * _PCIE_RATIO,
    attn_bwd_eff=A100.attn_bwd_eff * _PCIE_RATIO,
    mem_eff=0.84,
    intra_gbs=31.5,
    intra_eff=MA100P.INTRA_EFF,
    intra_latency_us=8.0,
    nic_gbs=12.5,
    inter_eff=0.96,
    elementwise_eff=ELEM_EFF,
    permute_eff=MA100P.PERMUTE_EFF,
    gemm_model=_A100_PCIE_GEMM,
    attn_model=_A100_PCIE_ATTN,
    linear_table=MB200.linear_table(MA100P.LINEARS),
    grouped_table=MB200.grouped_table(MA100P.GROUPED),
    attn_shape_table=MB200.attention_samples(MA100P.ATTENTION),
    intra_tier="pcie-a100",
    inter_tier="ib",
    source="NVIDIA A100 PCIe datasheet; efficiencies: see `sources`",
    sources=(
        ("bf16_tflops", "NVIDIA A100 PCIe datasheet: 312 TF dense BF16, 300 W"),
        ("hbm_gbs", "NVIDIA A100 80GB PCIe datasheet: 1,935 GB/s"),
        ("gemm_model", f"fitted to {MA100P.SOURCE} (61 linears x 3 forms)"),
        ("attn_model", f"fitted to {MA100P.SOURCE} (12 shapes)"),
        ("linear_table", MA100P.SOURCE + ": 61 linears' three GEMMs"),
        ("grouped_table", MA100P.SOURCE + ": TE grouped GEMMs of routed experts"),
        ("attn_shape_table", MA100P.SOURCE + ": TE flash attention, halved to causal FLOPs"),
        ("permute_eff", MA100P.SOURCE + ": TE fused permutation 0.1879 of 1,600 GiB/s"),
        ("mem_eff", MEM + "; assumed alike"),
        ("intra_gbs", "PCIe Gen4 x16: 31.5 GB/s a direction; no NVLink bridge"),
        ("intra_eff", MA100P.NCCL_SOURCE + ": 2-rank all-reduce 0.6965 of 30 GiB/s"),
        ("intra_tier", MA100P.NCCL_SOURCE + ": each kind and group size (2, 4, 8)"),
        ("nic_gbs", "assumed: one 200 Gb/s NIC per two GPUs"),
        ("inter_eff", NIC_EFF),
        ("step_eff", "1, as the A100 SXM part"),
    ),
)

# H100 SXM5 80GB: 132 SMs, 989.4 TF BF16 / 1978.9 FP8, HBM3 3.35 TB/s, NVLink4 900 GB/s both
# ways, DGX H100: 8x ConnectX-7 400 Gb/s.
_H100_ATTN = _attn(0.62, 0.44, 512.0, f"{STEP_8K}: FlashAttention-3 45% fwd+bwd at 8K")


def _hopper(name: str, hbm_gib: float, hbm_gbs: float, mamf: float) -> HardwareProfile:
    model = _gemm(132, mamf / 989.4, (6144, 17920, 2816), f"{MAMF}: {mamf} TF")
    return HardwareProfile(
        name,
        989.4,
        1978.9,
        hbm_gib,
        hbm_gbs,
        mamf / 989.4,
        fp8_speedup=1453.4 / 794.5,
        attn_fwd_eff=0.62 * 4096 / 4608,
        attn_bwd_eff=0.44 * 4096 / 4608,
        mem_eff=0.84,
        intra_eff=232.5 / 300,
        inter_eff=0.96,
        elementwise_eff=ELEM_EFF,
        gemm_model=model,
        attn_model=_H100_ATTN,
        intra_tier="nvlink",
        inter_tier="ib",
        step_eff=STEP_EFF_H100,
        source=f"NVIDIA {name.upper()} datasheet; efficiencies: see `sources`",
        sources=(
            ("bf16_tflops", "NVIDIA H100/H200 SXM datasheet: 989.4 TF BF16, 1978.9 FP8 dense"),
            ("hbm_gbs", f"NVIDIA {name.upper()} SXM datasheet: {hbm_gbs:,.0f} GB/s"),
            ("gemm_model", model.source + " at 6144x17920x2816 (H100 SXM); 132 SMs"),
            ("fp8_speedup", f"{MAMF}: H200 FP8 1453.4 over BF16 794.5 TF"),
            ("attn_model", _H100_ATTN.source),
            ("mem_eff", MEM),
            ("elementwise_eff", ELEM),
            ("intra_gbs", "NVLink4: 900 GB/s both ways, 450 a direction"),
            ("intra_eff", NVLINK_EFF + "; the same share assumed"),
            ("nic_gbs", "DGX H100: one ConnectX-7 400 Gb/s per GPU"),
            ("inter_eff", NIC_EFF),
            ("step_eff", STEP),
        ),
    )


# B200 (DGX B200): 148 SMs, 2.25 PF BF16 / 4.5 PF FP8 dense, 180 GB HBM3e at 8 TB/s, NVLink5
# 1.8 TB/s both ways, 8x ConnectX-7 400 Gb/s. Kernels: the public per-shape measurements of
# `measured_b200` (TE 2.11 on one B200) as tables, and the GEMM and attention models fitted to
# them (`kernels.fit_gemm_model`, `fit_attention_model`; the constants are their result,
# checked by tests/unit/test_planner_kernels_b200.py) for the shapes they lack. Measured at
# the shapes a job runs, as `plan calibrate` does, so no step efficiency on top (1, as for
# calibrated profiles); the MAMF figure (1745 TF at a shape NVIDIA does not publish) stays as
# ``gemm_eff`` and the FP8 ratio.
_B200_GEMM = GemmModel(148, 0.51932, 304.437, source=f"fitted to {MB200.SOURCE}")
_B200_ATTN = AttentionModel(
    0.52768, 0.38938, 0.0, source=f"fitted to {MB200.SOURCE}", fwd_rows_half=65536.0,
    bwd_rows_half=11585.24,
)  # fmt: skip
B200 = HardwareProfile(
    "b200",
    2250.0,
    4500.0,
    179.0,
    8000,
    1745.0 / 2250.0,
    fp8_speedup=3432.5 / 1745.0,
    attn_fwd_eff=0.50 * 4096 / 4608,
    attn_bwd_eff=0.36 * 4096 / 4608,
    mem_eff=0.84,
    intra_gbs=900.0,
    intra_eff=MB200.INTRA_EFF,
    inter_eff=0.96,
    elementwise_eff=ELEM_EFF,
    gemm_model=_B200_GEMM,
    attn_model=_B200_ATTN,
    linear_table=MB200.linear_table(),
    grouped_table=MB200.grouped_table(),
    attn_shape_table=MB200.attention_samples(),
    permute_eff=MB200.PERMUTE_EFF,
    intra_tier="nvlink5",
    inter_tier="ib",
    kernel_latency_us=MB200.KERNEL_LATENCY_US,
    step_eff=1.0,
    source="NVIDIA DGX B200 datasheet; efficiencies: see `sources`",
    sources=(
        ("bf16_tflops", "NVIDIA DGX B200 datasheet: 2.25 PF BF16, 4.5 PF FP8 dense per GPU"),
        ("hbm_gbs", "NVIDIA DGX B200 datasheet: 8 TB/s HBM3e"),
        ("gemm_eff", f"{MAMF}: B200 1745 TF"),
        ("gemm_model", _B200_GEMM.source),
        ("linear_table", MB200.SOURCE + ": 144 linears' three GEMMs"),
        ("grouped_table", MB200.SOURCE + ": TE grouped GEMMs of routed experts"),
        ("attn_shape_table", MB200.SOURCE + ": TE flash attention, halved to causal FLOPs"),
        ("permute_eff", MB200.SOURCE + ": TE fused permutation 0.5008 / 0.5108 of 8,000 GiB/s"),
        ("fp8_speedup", f"{MAMF}: B200 FP8 3432.5 over BF16 1745 TF"),
        ("attn_model", _B200_ATTN.source),
        ("mem_eff", MEM + "; assumed alike"),
        ("elementwise_eff", ELEM),
        ("intra_gbs", "NVLink5: 1.8 TB/s both ways, 900 a direction"),
        ("intra_eff", MB200.NCCL_SOURCE + ": all-reduce 0.7424 of 900 GiB/s (717 GB/s)"),
        ("intra_tier", MB200.NCCL_SOURCE + ": each kind's efficiency and latencies"),
        ("kernel_latency_us", MB200.KERNEL_LATENCY_SOURCE),
        ("nic_gbs", "DGX B200: ConnectX-7 400 Gb/s per GPU"),
        ("inter_eff", NIC_EFF),
        ("step_eff", "1: kernels measured at the job's shapes (as calibrated profiles)"),
    ),
)

# MI300X: 304 CUs, 1307.4 TF BF16 / 2614.9 FP8 dense, 192 GB HBM3 at 5.3 TB/s, 7 Infinity
# Fabric links of 64 GB/s a direction (448), platform NICs 400 Gb/s per GPU.
_MI300X_GEMM = _gemm(304, 781.9 / 1300, (4096, 10240, 4864), f"{MAMF}: MI300X 781.9 TF")
MI300X = HardwareProfile(
    "mi300x",
    1307.4,
    2614.9,
    192.0,
    5300,
    781.9 / 1300.0,
    attn_fwd_eff=0.4,
    attn_bwd_eff=0.3,
    mem_eff=0.84,
    intra_gbs=448.0,
    intra_eff=0.7,
    inter_eff=0.96,
    elementwise_eff=ELEM_EFF,
    gemm_model=_MI300X_GEMM,
    attn_model=_attn(0.45, 0.34, 512.0, "assumed: two thirds of H100's FlashAttention-3"),
    intra_tier="xgmi",
    inter_tier="ib",
    step_eff=STEP_EFF_H100,
    source="AMD MI300X datasheet; efficiencies: see `sources`",
    sources=(
        ("bf16_tflops", "AMD MI300X datasheet: 1307.4 TF BF16, 2614.9 FP8 dense"),
        ("hbm_gbs", "AMD MI300X datasheet: 5.3 TB/s HBM3"),
        (
            "gemm_model",
            _MI300X_GEMM.source + " at 4096x10240x4864 (ROCm 6.2); 304 CUs, "
            "NVIDIA's tile set assumed",
        ),  # fmt: skip
        ("fp8_speedup", "no published FP8 MAMF: 1.55 assumed"),
        ("attn_model", "assumed"),
        ("mem_eff", "assumed as NVIDIA's HBM parts"),
        ("intra_gbs", "7 Infinity Fabric links x 64 GB/s a direction"),
        ("intra_eff", "assumed"),
        ("inter_eff", NIC_EFF),
        ("step_eff", "H100's assumed: " + STEP),
    ),
)

# MTT S4000: 100 TF BF16 (no FP8 listed), 48 GB GDDR6 at 768 GB/s, MTLink 240 GB/s (taken as
# both ways), one 200 Gb/s RoCE NIC per GPU. Nothing measured is published: every efficiency
# is a placeholder until `plan calibrate` runs on one.
MTT_S4000 = HardwareProfile(
    "mtt-s4000",
    100.0,
    0.0,
    48.0,
    768,
    0.6,
    fp8_speedup=1.0,
    attn_fwd_eff=0.4,
    attn_bwd_eff=0.3,
    mem_eff=0.8,
    intra_gbs=120.0,
    intra_eff=0.7,
    nic_gbs=25.0,
    inter_eff=0.9,
    elementwise_eff=ELEM_EFF,
    gemm_model=_gemm(64, 0.6, (8192, 8192, 4096), "placeholder 0.6 at a large shape"),
    attn_model=_attn(0.42, 0.32, 512.0, "placeholder"),
    intra_tier="mtlink",
    inter_tier="ib",
    step_eff=STEP_EFF_H100,
    source="Moore Threads S4000 product page; every efficiency a placeholder",
    sources=(
        ("bf16_tflops", "Moore Threads MTT S4000 product page: 100 TF BF16"),
        ("hbm_gbs", "product page: 48 GB GDDR6, 768 GB/s"),
        ("gemm_model", "placeholder: 0.6 at 8192x8192x4096; 64 compute units assumed"),
        ("attn_model", "placeholder"),
        ("intra_gbs", "MTLink 240 GB/s taken as both ways"),
        ("nic_gbs", "assumed: one 200 Gb/s RoCE NIC per GPU"),
        ("step_eff", "H100's assumed: " + STEP),
    ),
)

H100 = _hopper("h100", 80.0, 3350, 792.1)
H200 = _hopper("h200", 140.0, 4800, 794.5)

PROFILES: dict[str, HardwareProfile] = {
    "h100": H100,
    "h200": H200,
    "a100": A100,
    "a100-pcie": A100_PCIE,
    "b200": B200,
    "mi300x": MI300X,
    "mtt-s4000": MTT_S4000,
}
