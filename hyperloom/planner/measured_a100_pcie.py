"""Public kernel microbenchmarks of the A100 80GB PCIe: the built-in profile's per-shape
efficiencies.

Moore Threads' SimuMax publishes the system file it simulates A100 PCIe runs with,
``configs/system/a100_pcie.json`` (MooreThreads/SimuMax, commit 4dcaae5, May 2026): per-shape
efficiencies of BF16 GEMMs, grouped GEMMs and flash attention timed on one A100 PCIe by its
``simu_tools/efficency_test`` scripts (each kernel alone, after warm-up), the shapes of Llama 3
8B / 70B and DeepSeek-V2 layers at every tp and ep of one 8-GPU node. Kernel measurements,
not step times: the same lab's Megatron-LM runs on that node stay held out (validation 6d,
`published_a100_pcie`). The tables restate the file's numbers (three decimals) in the forms of
`measured_b200` (whose functions read them): each linear's forward, data- and weight-gradient
(accumulating into FP32 main gradients) efficiency of the 312 TFLOP/s BF16 peak; TE's grouped
GEMMs of the routed experts; causal flash attention on SimuMax's full-square FLOPs (halved by
`measured_b200.attention_samples`).

`PERMUTE_EFF`: TE's fused MoE permutation, 0.1879 of 1,600 GiB/s forward and backward after
40 us per launch (``test_ce_permute_efficiency.py``), over the datasheet's 1,935 GB/s. The
40 us is not charged: the profile has no per-call latency (`launches.py`).

`NCCL_FIT`: the same file's nccl-tests fits on that node (``networks.intra_node_pcie_{2,4,8}x``)
per group size and collective: bus efficiency of 30 GiB/s and per-step latency, in SimuMax's
``compute_net_op_time`` form (the planner's ring form: steps x latency + bytes x scale
(n-1)/n / bandwidth). Two and four GPUs reach about 0.69 (22 GB/s: one PCIe switch), eight
0.28-0.45 (across the sockets); the `pcie-a100` tier (`network.py`) carries them.

Not taken: the file's bandwidth factor of other memory-bound kernels (0.91, its template's
value), its cross-entropy rate, its fixed bandwidths of strided data-parallel groups
(``dp_fixed_bw``: the tier's shared-span term models those, and is checked against them) and
its FP8 entries (none measured).
"""

from __future__ import annotations

SOURCE = (
    "MooreThreads/SimuMax configs/system/a100_pcie.json (commit 4dcaae5): kernels timed alone "
    "on one A100 80GB PCIe"
)
PEAK_TFLOPS = 312.0
PERMUTE_EFF = 0.1879 * 1600 * 1024**3 / 1e9 / 1935.0
NCCL_SOURCE = (
    "MooreThreads/SimuMax configs/system/a100_pcie.json (commit 4dcaae5): nccl-tests on one "
    "8-GPU A100 PCIe node, fitted per collective and group size"
)
# ranks: {kind: (bus efficiency of 30 GiB/s, per-step latency us)}; p2p at the link's 0.5
NCCL_FIT: dict[int, dict[str, tuple[float, float]]] = {
    2: {
        "all_reduce": (0.6965, 15.51),
        "all_gather": (0.6866, 24.84),
        "reduce_scatter": (0.6419, 131.3),
        "all_to_all": (0.6969, 24.07),
        "p2p": (0.5, 10.0),
    },
    4: {
        "all_reduce": (0.6924, 3.45),
        "all_gather": (0.6915, 8.93),
        "reduce_scatter": (0.6845, 29.88),
        "all_to_all": (0.638, 13.84),
    },
    8: {
        "all_reduce": (0.4176, 8.98),
        "all_gather": (0.4497, 4.83),
        "reduce_scatter": (0.3688, 15.64),
        "all_to_all": (0.2754, 30.04),
    },
}
# The 2-rank all-reduce's bus bandwidth over PCIe Gen4 x16's 31.5 GB/s (30 GiB/s x 0.6965)
INTRA_EFF = NCCL_FIT[2]["all_reduce"][0] * 30 * 1024**3 / 1e9 / 31.5

# (tokens, in, out, fwd, dgrad, wgrad)
LINEARS: tuple[tuple[int, int, int, float, float, float], ...] = (
    (4096, 512, 4096, 0.61, 0.539, 0.491),
    (4096, 512, 32768, 0.618, 0.715, 0.669),
    (4096, 1024, 4096, 0.616, 0.458, 0.466),
    (4096, 1024, 8192, 0.602, 0.488, 0.628),
    (4096, 1536, 24576, 0.697, 0.738, 0.714),
    (4096, 1792, 4096, 0.68, 0.548, 0.698),
    (4096, 2048, 4096, 0.682, 0.613, 0.602),
    (4096, 2048, 7168, 0.681, 0.715, 0.629),
    (4096, 2048, 8192, 0.679, 0.7, 0.688),
    (4096, 3072, 5120, 0.718, 0.695, 0.675),
    (4096, 3584, 4096, 0.706, 0.645, 0.634),
    (4096, 3584, 8192, 0.694, 0.67, 0.676),
    (4096, 4096, 768, 0.765, 0.716, 0.725),
    (4096, 4096, 1536, 0.783, 0.746, 0.656),
    (4096, 4096, 3072, 0.758, 0.71, 0.647),
    (4096, 4096, 3584, 0.657, 0.727, 0.625),
    (4096, 4096, 4096, 0.721, 0.725, 0.693),
    (4096, 4096, 6144, 0.717, 0.741, 0.668),
    (4096, 4096, 7168, 0.711, 0.742, 0.681),
    (4096, 4096, 8192, 0.712, 0.745, 0.691),
    (4096, 4096, 14336, 0.738, 0.758, 0.702),
    (4096, 4096, 16128, 0.734, 0.758, 0.693),
    (4096, 4096, 28672, 0.737, 0.736, 0.712),
    (4096, 4096, 32128, 0.731, 0.732, 0.703),
    (4096, 4096, 64256, 0.746, 0.753, 0.711),
    (4096, 4096, 128384, 0.746, 0.753, 0.709),
    (4096, 5120, 576, 0.497, 0.592, 0.596),
    (4096, 5120, 1536, 0.788, 0.738, 0.624),
    (4096, 5120, 6144, 0.699, 0.768, 0.714),
    (4096, 5120, 24576, 0.75, 0.784, 0.717),
    (4096, 5120, 102400, 0.755, 0.762, 0.715),
    (4096, 7168, 576, 0.498, 0.644, 0.45),
    (4096, 7168, 1536, 0.803, 0.71, 0.574),
    (4096, 7168, 4096, 0.741, 0.712, 0.691),
    (4096, 7168, 8192, 0.728, 0.722, 0.7),
    (4096, 7168, 36864, 0.76, 0.764, 0.718),
    (4096, 7168, 129280, 0.751, 0.755, 0.712),
    (4096, 8192, 1280, 0.663, 0.723, 0.682),
    (4096, 8192, 2560, 0.791, 0.696, 0.702),
    (4096, 8192, 5120, 0.755, 0.721, 0.707),
    (4096, 8192, 7168, 0.721, 0.736, 0.702),
    (4096, 8192, 8192, 0.733, 0.739, 0.714),
    (4096, 8192, 10240, 0.755, 0.754, 0.704),
    (4096, 8192, 14336, 0.75, 0.74, 0.707),
    (4096, 8192, 16128, 0.749, 0.742, 0.704),
    (4096, 8192, 28672, 0.748, 0.746, 0.707),
    (4096, 8192, 32128, 0.747, 0.749, 0.706),
    (4096, 8192, 57344, 0.753, 0.755, 0.71),
    (4096, 8192, 64128, 0.746, 0.754, 0.707),
    (4096, 8192, 128256, 0.745, 0.745, 0.708),
    (4096, 12288, 5120, 0.772, 0.74, 0.72),
    (4096, 14336, 4096, 0.738, 0.737, 0.709),
    (4096, 14336, 8192, 0.742, 0.753, 0.705),
    (4096, 16384, 5120, 0.749, 0.761, 0.719),
    (4096, 16384, 7168, 0.742, 0.765, 0.717),
    (4096, 18432, 7168, 0.739, 0.757, 0.717),
    (4096, 28672, 8192, 0.741, 0.756, 0.712),
    (24640, 1536, 5120, 0.703, 0.752, 0.725),
    (24640, 5120, 3072, 0.741, 0.735, 0.761),
    (33024, 2048, 7168, 0.732, 0.747, 0.742),
    (33024, 7168, 4096, 0.751, 0.749, 0.755),
)

# (groups, rows per group, in, out, fwd, dgrad, wgrad)
GROUPED: tuple[tuple[int, int, int, int, float, float, float], ...] = (
    (20, 1232, 1536, 5120, 0.675, 0.657, 0.637),
    (20, 1232, 5120, 3072, 0.707, 0.704, 0.604),
    (40, 616, 1536, 5120, 0.629, 0.658, 0.52),
    (40, 616, 5120, 3072, 0.631, 0.679, 0.52),
)

# (seq, heads, kv heads, qk head dim, v head dim, fwd, bwd) on SimuMax's full-square FLOPs
ATTENTION: tuple[tuple[int, int, int, int, int, float, float], ...] = (
    (4096, 4, 1, 128, 128, 0.514, 0.675),
    (4096, 8, 1, 128, 128, 0.786, 0.76),
    (4096, 8, 2, 128, 128, 0.777, 0.763),
    (4096, 16, 2, 128, 128, 0.988, 0.888),
    (4096, 16, 4, 128, 128, 0.991, 0.882),
    (4096, 16, 16, 192, 128, 0.916, 0.752),
    (4096, 32, 4, 128, 128, 1.119, 0.966),
    (4096, 32, 8, 128, 128, 1.132, 0.976),
    (4096, 32, 32, 192, 128, 1.015, 0.78),
    (4096, 64, 8, 128, 128, 1.187, 1.005),
    (4096, 64, 64, 192, 128, 1.054, 0.794),
    (4096, 128, 128, 192, 128, 1.073, 0.802),
)
