"""Public kernel microbenchmarks of the B200: the built-in profile's per-shape efficiencies.

Moore Threads' SimuMax publishes the system file it simulates B200 runs with,
``configs/system/b200_bf16_ceperm.json`` (MooreThreads/SimuMax, commit 4dcaae5, May 2026):
per-shape efficiencies of BF16 GEMMs, grouped GEMMs and flash attention, timed on one B200
with TransformerEngine 2.11 by the repository's ``simu_tools/efficency_test`` scripts (each
kernel alone, after warm-up). They are kernel measurements, not step times, and they are what
the `b200` profile now takes its kernel efficiencies from (docs/planner.md, validation 6c: the
same lab's Megatron-LM step times stay held out; no number here was set from them).

The tables below restate that file's numbers (three decimals), rearranged:

- `LINEARS`: one row per linear, its forward (tokens x in) @ (in x out) as (tokens, in, out),
  then the efficiency of the forward (TN), the data gradient (NN) and the weight gradient
  (NT, accumulating into the FP32 main gradient), each a fraction of the 2,250 TFLOP/s BF16
  peak. `gemm_samples` turns them into ((m, n, k), eff) pairs of `kernels.gemm_forms`.
- `GROUPED`: TE's grouped GEMM of the routed experts (Megatron's ``--moe-grouped-gemm``) as
  (groups, rows per group, in, out, fwd, dgrad, wgrad), FP32 main gradients.
- `ATTENTION`: TE's causal flash attention (contiguous q/k/v) as (seq, query heads, kv heads,
  qk head dim, v head dim, fwd, bwd). SimuMax counts the full s x s product (forward
  2 s^2 h (d_qk + d_v), backward 2.5x that) although the causal kernel computes half; the
  planner counts executed FLOPs (`model.Layer.attn_flops`), so `attention_samples` halves
  them.

`PERMUTE_EFF`: TE's fused MoE permutation and un-permutation (Megatron's
``--moe-permute-fusion``), timed by the repository's ``test_ce_permute_efficiency.py`` at
0.5008 (forward) and 0.5108 (backward) of 8,000 GiB/s after 30 us per launch; their mean in
GB/s over the datasheet's 8,000 GB/s (`HardwareProfile.permute_eff`).

Not taken: the file's memory bandwidth factor (0.666 for every memory-bound kernel is a
default of its ``combine_efficiency.py``, not a measurement) and its FP8 entries (none
measured).

`NCCL_FIT`: the same file's fit of nccl-tests on one 8-GPU B200 node (its
``simu_tools/efficency_test/nccl_fit.py``), per collective: bus efficiency over NVLink5's 900,
per-step latency and once-per-call latency, in the form ``fixed + steps x latency + bytes x
scale (n-1)/n / (eff x 900 GiB/s)`` (SimuMax's ``compute_net_op_time``). Its bandwidth is in
GiB/s (it divides bytes by ``gbps * 1024**3``), so the all-reduce's bus bandwidth is 0.7424 x
900 GiB/s = 717 GB/s: the profile's ``intra_eff`` is that over the datasheet's 900 GB/s
(`INTRA_EFF`; before: 0.7424 of 900 GB/s, 7% slow). The `nvlink5` tier (`network.py`)
carries the other kinds. The all-to-all's fixed part is 0 at 8 ranks and 19 / 51 us at 4 / 2
in that fit; the planner keeps one value per kind, the 8-rank one (the ep4 runs it misprices
by 19 us a call, about 0.1 ms a step).
"""

from __future__ import annotations

from hyperloom.planner.kernels import gemm_forms

SOURCE = (
    "MooreThreads/SimuMax configs/system/b200_bf16_ceperm.json (commit 4dcaae5): "
    "TransformerEngine 2.11 kernels timed alone on one B200"
)
PEAK_TFLOPS = 2250.0
ALLREDUCE_BUS_EFF = 0.7424  # its NCCL fit, intra-node all-reduce (high_intra_node)
NCCL_SOURCE = (
    "MooreThreads/SimuMax configs/system/b200_bf16_ceperm.json (commit 4dcaae5): nccl-tests "
    "on one DGX B200 node, fitted per collective (networks.high_intra_node.op)"
)
# kind: (bus efficiency of 900 GiB/s, per-step latency us, once-per-call latency us)
NCCL_FIT: dict[str, tuple[float, float, float]] = {
    "all_reduce": (0.7424, 5.5183, 22.2316),
    "all_gather": (0.6735, 9.1828, 23.1049),
    "reduce_scatter": (0.6731, 8.0325, 25.5604),
    "all_to_all": (0.5968, 7.3039, 0.0),
}
# The all-reduce's bus bandwidth over the datasheet's 900 GB/s: the fit's GiB/s in GB/s.
INTRA_EFF = ALLREDUCE_BUS_EFF * 1024**3 / 1e9
# TE's fused permutation, forward and backward, of 8,000 GiB/s; their mean over 8,000 GB/s
PERMUTE_EFF = (0.5008 + 0.5108) / 2 * 1024**3 / 1e9
# A memory-bound module's fixed cost per call (`launches.py`): the same file's
# accelerator.bandwidth latency, a default of its combine_efficiency.py template (a prior)
KERNEL_LATENCY_US = 30.0
KERNEL_LATENCY_SOURCE = (
    "MooreThreads/SimuMax configs/system/b200_bf16_ceperm.json (commit 4dcaae5): "
    "accelerator.bandwidth latency_us 30 per memory-bound op, its template's default "
    "(a prior, not a measurement)"
)

# (tokens, in, out, fwd, dgrad, wgrad)
LINEARS: tuple[tuple[int, int, int, float, float, float], ...] = (
    (2048, 2048, 8192, 0.453, 0.436, 0.343),
    (2048, 4096, 8192, 0.430, 0.417, 0.454),
    (2048, 4096, 16384, 0.570, 0.458, 0.359),
    (2048, 7168, 8192, 0.480, 0.473, 0.460),
    (2048, 8192, 2560, 0.353, 0.485, 0.380),
    (2048, 8192, 5120, 0.474, 0.461, 0.413),
    (2048, 8192, 14336, 0.540, 0.520, 0.483),
    (2048, 8192, 28672, 0.475, 0.480, 0.424),
    (2048, 8192, 32128, 0.498, 0.504, 0.417),
    (2048, 8192, 64128, 0.497, 0.505, 0.406),
    (2048, 13312, 16384, 0.461, 0.550, 0.461),
    (2048, 14336, 8192, 0.508, 0.575, 0.485),
    (2048, 16384, 5120, 0.452, 0.556, 0.445),
    (2048, 16384, 26624, 0.480, 0.491, 0.413),
    (2048, 16384, 32128, 0.512, 0.487, 0.413),
    (4096, 512, 4096, 0.368, 0.532, 0.503),
    (4096, 512, 32768, 0.319, 0.398, 0.487),
    (4096, 1024, 4096, 0.616, 0.630, 0.586),
    (4096, 1024, 8192, 0.617, 0.614, 0.584),
    (4096, 1536, 24576, 0.633, 0.637, 0.461),
    (4096, 1792, 4096, 0.639, 0.461, 0.430),
    (4096, 2048, 4096, 0.647, 0.636, 0.617),
    (4096, 2048, 7168, 0.437, 0.383, 0.389),
    (4096, 2048, 8192, 0.622, 0.553, 0.516),
    (4096, 2048, 16384, 0.487, 0.433, 0.536),
    (4096, 3072, 5120, 0.423, 0.393, 0.344),
    (4096, 3584, 4096, 0.391, 0.467, 0.501),
    (4096, 3584, 8192, 0.503, 0.498, 0.404),
    (4096, 4096, 768, 0.446, 0.409, 0.391),
    (4096, 4096, 1536, 0.643, 0.639, 0.605),
    (4096, 4096, 3072, 0.637, 0.639, 0.599),
    (4096, 4096, 3584, 0.616, 0.636, 0.540),
    (4096, 4096, 4096, 0.638, 0.637, 0.599),
    (4096, 4096, 6144, 0.653, 0.633, 0.609),
    (4096, 4096, 7168, 0.638, 0.618, 0.551),
    (4096, 4096, 8192, 0.460, 0.391, 0.570),
    (4096, 4096, 14336, 0.651, 0.505, 0.524),
    (4096, 4096, 16128, 0.635, 0.477, 0.535),
    (4096, 4096, 16384, 0.496, 0.508, 0.534),
    (4096, 4096, 28672, 0.524, 0.539, 0.588),
    (4096, 4096, 32128, 0.626, 0.511, 0.438),
    (4096, 4096, 64256, 0.526, 0.500, 0.433),
    (4096, 4096, 128384, 0.502, 0.508, 0.447),
    (4096, 5120, 160, 0.184, 0.167, 0.187),
    (4096, 5120, 576, 0.322, 0.321, 0.224),
    (4096, 5120, 1536, 0.414, 0.637, 0.573),
    (4096, 5120, 6144, 0.389, 0.446, 0.486),
    (4096, 5120, 24576, 0.565, 0.494, 0.437),
    (4096, 5120, 102400, 0.487, 0.457, 0.445),
    (4096, 6656, 16384, 0.478, 0.493, 0.437),
    (4096, 7168, 256, 0.232, 0.219, 0.271),
    (4096, 7168, 576, 0.588, 0.523, 0.485),
    (4096, 7168, 1536, 0.596, 0.599, 0.545),
    (4096, 7168, 4096, 0.383, 0.503, 0.409),
    (4096, 7168, 8192, 0.476, 0.469, 0.408),
    (4096, 7168, 36864, 0.485, 0.433, 0.449),
    (4096, 7168, 129280, 0.489, 0.426, 0.448),
    (4096, 8192, 1280, 0.594, 0.631, 0.522),
    (4096, 8192, 2560, 0.584, 0.655, 0.562),
    (4096, 8192, 5120, 0.627, 0.643, 0.473),
    (4096, 8192, 7168, 0.611, 0.444, 0.474),
    (4096, 8192, 8192, 0.463, 0.496, 0.479),
    (4096, 8192, 10240, 0.645, 0.498, 0.598),
    (4096, 8192, 14336, 0.494, 0.492, 0.476),
    (4096, 8192, 16128, 0.588, 0.490, 0.450),
    (4096, 8192, 16384, 0.453, 0.473, 0.453),
    (4096, 8192, 28672, 0.494, 0.482, 0.454),
    (4096, 8192, 32128, 0.492, 0.492, 0.444),
    (4096, 8192, 57344, 0.487, 0.483, 0.454),
    (4096, 8192, 64128, 0.490, 0.466, 0.453),
    (4096, 8192, 128256, 0.487, 0.471, 0.455),
    (4096, 12288, 5120, 0.449, 0.485, 0.445),
    (4096, 13312, 16384, 0.508, 0.480, 0.447),
    (4096, 14336, 4096, 0.455, 0.559, 0.454),
    (4096, 14336, 8192, 0.476, 0.494, 0.457),
    (4096, 16384, 2560, 0.605, 0.596, 0.452),
    (4096, 16384, 5120, 0.629, 0.467, 0.480),
    (4096, 16384, 7168, 0.456, 0.493, 0.472),
    (4096, 16384, 10240, 0.553, 0.489, 0.477),
    (4096, 16384, 13312, 0.495, 0.502, 0.444),
    (4096, 16384, 16128, 0.510, 0.515, 0.449),
    (4096, 16384, 16384, 0.510, 0.515, 0.452),
    (4096, 16384, 20480, 0.533, 0.513, 0.455),
    (4096, 16384, 26624, 0.497, 0.513, 0.451),
    (4096, 16384, 32128, 0.499, 0.511, 0.452),
    (4096, 16384, 53248, 0.489, 0.512, 0.455),
    (4096, 16384, 64128, 0.494, 0.512, 0.453),
    (4096, 16384, 106496, 0.496, 0.512, 0.456),
    (4096, 16384, 128256, 0.491, 0.511, 0.455),
    (4096, 18432, 7168, 0.430, 0.491, 0.455),
    (4096, 26624, 16384, 0.508, 0.498, 0.455),
    (4096, 28672, 8192, 0.485, 0.474, 0.459),
    (4096, 53248, 16384, 0.511, 0.501, 0.454),
    (8192, 4096, 8192, 0.561, 0.483, 0.442),
    (8192, 8192, 5120, 0.453, 0.502, 0.494),
    (8192, 8192, 16384, 0.477, 0.511, 0.450),
    (8192, 8192, 28672, 0.480, 0.505, 0.440),
    (8192, 8192, 64128, 0.481, 0.510, 0.445),
    (8192, 14336, 8192, 0.498, 0.478, 0.444),
    (8192, 16384, 10240, 0.491, 0.471, 0.465),
    (8192, 16384, 53248, 0.485, 0.507, 0.446),
    (8192, 16384, 64128, 0.478, 0.509, 0.446),
    (8192, 26624, 16384, 0.503, 0.492, 0.454),
    (16384, 512, 32768, 0.421, 0.466, 0.468),
    (16384, 1536, 24576, 0.506, 0.476, 0.511),
    (16384, 3072, 5120, 0.528, 0.513, 0.437),
    (16384, 5120, 160, 0.326, 0.158, 0.267),
    (16384, 5120, 576, 0.279, 0.433, 0.455),
    (16384, 5120, 1536, 0.423, 0.446, 0.366),
    (16384, 5120, 6144, 0.518, 0.514, 0.470),
    (16384, 5120, 24576, 0.501, 0.496, 0.492),
    (16384, 5120, 102400, 0.507, 0.500, 0.492),
    (16384, 8192, 8192, 0.476, 0.472, 0.490),
    (16384, 8192, 10240, 0.475, 0.499, 0.548),
    (16384, 8192, 57344, 0.482, 0.505, 0.469),
    (16384, 8192, 128256, 0.485, 0.479, 0.462),
    (16384, 12288, 5120, 0.500, 0.501, 0.484),
    (16384, 16384, 5120, 0.506, 0.498, 0.482),
    (16384, 28672, 8192, 0.509, 0.483, 0.483),
    (24640, 1536, 5120, 0.522, 0.471, 0.395),
    (24640, 5120, 3072, 0.527, 0.485, 0.498),
    (32768, 2048, 7168, 0.483, 0.440, 0.444),
    (32768, 4096, 8192, 0.495, 0.462, 0.485),
    (32768, 7168, 4096, 0.470, 0.500, 0.431),
    (32768, 8192, 5120, 0.470, 0.492, 0.472),
    (32768, 8192, 16384, 0.476, 0.503, 0.498),
    (32768, 8192, 28672, 0.479, 0.475, 0.485),
    (32768, 8192, 64128, 0.479, 0.468, 0.459),
    (32768, 14336, 8192, 0.499, 0.476, 0.490),
    (32768, 16384, 10240, 0.498, 0.466, 0.492),
    (32768, 16384, 53248, 0.475, 0.462, 0.455),
    (32768, 16384, 64128, 0.471, 0.462, 0.451),
    (32768, 26624, 16384, 0.472, 0.476, 0.462),
    (65536, 512, 32768, 0.378, 0.442, 0.454),
    (65536, 1536, 24576, 0.472, 0.499, 0.484),
    (65536, 3072, 5120, 0.491, 0.480, 0.487),
    (65536, 5120, 160, 0.345, 0.160, 0.393),
    (65536, 5120, 576, 0.356, 0.490, 0.453),
    (65536, 5120, 1536, 0.471, 0.478, 0.542),
    (65536, 5120, 6144, 0.490, 0.480, 0.445),
    (65536, 5120, 24576, 0.500, 0.483, 0.498),
    (65536, 5120, 102400, 0.504, 0.460, 0.469),
    (65536, 12288, 5120, 0.496, 0.495, 0.481),
    (65536, 16384, 5120, 0.488, 0.496, 0.483),
)

# (groups, rows per group, in, out, fwd, dgrad, wgrad)
GROUPED: tuple[tuple[int, int, int, int, float, float, float], ...] = (
    (20, 1232, 1536, 5120, 0.397, 0.389, 0.320),
    (20, 1232, 5120, 3072, 0.513, 0.422, 0.328),
    (32, 1024, 2048, 7168, 0.384, 0.430, 0.274),
    (32, 1024, 7168, 4096, 0.457, 0.435, 0.289),
    (40, 616, 1536, 5120, 0.326, 0.281, 0.272),
    (40, 616, 5120, 3072, 0.462, 0.321, 0.258),
    (40, 2460, 1536, 5120, 0.496, 0.489, 0.403),
    (40, 2460, 5120, 3072, 0.487, 0.452, 0.417),
    (40, 9832, 1536, 5120, 0.445, 0.463, 0.413),
    (40, 9832, 5120, 3072, 0.475, 0.476, 0.419),
    (64, 512, 2048, 7168, 0.427, 0.294, 0.215),
    (64, 512, 7168, 4096, 0.367, 0.405, 0.219),
    (80, 308, 1536, 5120, 0.235, 0.250, 0.178),
    (80, 308, 5120, 3072, 0.387, 0.304, 0.162),
    (128, 256, 2048, 7168, 0.303, 0.233, 0.141),
    (128, 256, 7168, 4096, 0.271, 0.333, 0.147),
    (160, 154, 1536, 5120, 0.116, 0.123, 0.083),
    (160, 154, 5120, 3072, 0.200, 0.195, 0.094),
    (256, 128, 2048, 7168, 0.178, 0.151, 0.080),
    (256, 128, 7168, 4096, 0.208, 0.226, 0.077),
)

# (seq, heads, kv heads, qk head dim, v head dim, fwd, bwd) on SimuMax's full-square FLOPs
ATTENTION: tuple[tuple[int, int, int, int, int, float, float], ...] = (
    (4096, 4, 1, 128, 128, 0.167, 0.346),
    (4096, 8, 1, 128, 128, 0.310, 0.659),
    (4096, 8, 2, 128, 128, 0.317, 0.633),
    (4096, 16, 2, 128, 128, 0.578, 0.755),
    (4096, 16, 4, 128, 128, 0.582, 0.742),
    (4096, 16, 16, 192, 128, 0.637, 0.593),
    (4096, 32, 4, 128, 128, 0.732, 0.796),
    (4096, 32, 8, 128, 128, 0.722, 0.787),
    (4096, 32, 32, 192, 128, 0.789, 0.610),
    (4096, 64, 8, 128, 128, 0.872, 0.729),
    (4096, 64, 64, 192, 128, 0.885, 0.609),
    (4096, 128, 16, 128, 128, 0.997, 0.832),
    (4096, 128, 128, 192, 128, 0.831, 0.643),
    (32768, 8, 1, 128, 128, 1.202, 0.955),
    (32768, 16, 2, 128, 128, 1.165, 0.872),
    (32768, 64, 64, 192, 128, 0.812, 0.649),
    (131072, 8, 1, 128, 128, 1.003, 0.826),
    (131072, 16, 2, 128, 128, 0.989, 0.827),
    (131072, 64, 64, 192, 128, 0.684, 0.658),
)


def gemm_samples(linears: tuple = LINEARS) -> list[tuple[tuple[float, float, float], float]]:
    """Every measured GEMM as ((m, n, k), efficiency), the three forms of each linear (of
    `linears`, rows as `LINEARS`; `measured_a100_pcie` passes its own)."""
    out = []
    for tokens, k, n, *effs in linears:
        out += list(zip(gemm_forms(tokens, n, k), effs, strict=True))
    return out


def linear_table(
    linears: tuple = LINEARS,
) -> tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]:
    """`HardwareProfile.linear_table`: forward (m, n, k) -> (fwd, dgrad, wgrad)."""
    return tuple(((float(t), float(n), float(k)), tuple(e)) for t, k, n, *e in linears)


def grouped_table(
    grouped: tuple = GROUPED,
) -> tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]:
    """`HardwareProfile.grouped_table`: (groups, m, n, k) -> (fwd, dgrad, wgrad)."""
    return tuple(((float(g), float(m), float(n), float(k)), tuple(e)) for g, m, k, n, *e in grouped)


def attention_samples(
    attention: tuple = ATTENTION,
) -> tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]:
    """`HardwareProfile.attn_shape_table`: (seq, query rows per key row = heads, qk head dim)
    -> (fwd, bwd) efficiency on executed (causal) FLOPs: SimuMax's figures halved."""
    return tuple(
        ((float(s), float(h), float(dq)), (fwd / 2, bwd / 2))
        for s, h, _, dq, _, fwd, bwd in attention
    )
