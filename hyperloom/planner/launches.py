"""A fixed cost per call of a layer's memory-bound modules: norms, activations, MoE routing.

Bytes over bandwidth (`HardwareProfile.elementwise_time`) prices what a norm or an activation
moves, but at a few megabytes per call a step spends more on each call than on its bytes:
the launch, the dispatcher's work on the host, and the tail of a kernel too short to fill
the device. SimuMax charges every memory-bound op a fixed latency on top of its bytes
(``accelerator.bandwidth.*.latency_us`` in its system files, added per call by
``SystemConfig.compute_mem_access_time``): 30 us on B200
(MooreThreads/SimuMax configs/system/b200_bf16_ceperm.json, commit 4dcaae5). That 30 us is
the default of its ``simu_tools/efficency_test/combine_efficiency.py`` template, not a
measurement; its measured cross-entropy and permutation efficiencies were fitted with it
(``test_ce_permute_efficiency.py`` subtracts 30 us per launch). The planner takes it as a
prior for the B200 profile (``HardwareProfile.kernel_latency_us``; 0 elsewhere, where no
such figure is published), and counts the calls as SimuMax's modules do for a Megatron-Core
layer with TransformerEngine (its ``dense_module.py`` / ``moe_module.py``):

- each RMSNorm (TE's norm ahead of the qkv and fc1 GEMMs; MLA adds its q and kv latent
  norms): forward, input gradient, weight gradient;
- each SwiGLU (the dense MLP; in an MoE layer the shared experts' and the routed experts'):
  forward and backward;
- MoE: the router (its GEMM's call each pass), token permutation and un-permutation
  (forward and backward each);
- the head: the final norm (three passes) and the fused cross-entropy (forward, backward).

Residual adds, RoPE and the embedding lookup are not counted (SimuMax prices them at zero
or inside other modules). Not scaled by ``step_eff``: a fixed time, like
``layer_overhead_s``, which a calibrated profile measures instead.
"""

from __future__ import annotations

from hyperloom.planner.costs import Phase
from hyperloom.planner.hardware import HardwareProfile
from hyperloom.planner.model import ModelSpec


def layer_calls(spec: ModelSpec) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) memory-bound module calls of the mean
    decoder layer (DeepSeek: dense and MoE layers weighted by their share)."""
    if not spec.mla:
        return 3.0, 3.0, 2.0  # two norms + the MLP activation; the norms' weight gradients
    wm = spec.n_moe_layers / spec.n_layers
    norms = 4.0  # attention and FFN inputs, MLA's q and kv latents
    acts = (1.0 - wm) + wm * ((1.0 if spec.n_shared_experts else 0.0) + 1.0)
    routing = wm * 3.0  # router, permute, un-permute
    return norms + acts + routing, norms + acts + routing, norms + wm


def layer_phase(spec: ModelSpec, acc: HardwareProfile, wgrad: bool = True) -> Phase:
    """The calls' fixed time for one layer and micro-batch (zero without a latency;
    `wgrad=False`: frozen weights, no weight-gradient calls)."""
    lat = acc.kernel_latency_us * 1e-6
    if not lat:
        return Phase()
    f, b, w = (lat * n for n in layer_calls(spec))
    w = w if wgrad else 0.0
    return Phase(f=f, b=b, w=w, compute=f + b + w)


def head_phase(acc: HardwareProfile, wgrad: bool = True) -> Phase:
    """The final norm (forward, input and weight gradient) and the cross-entropy
    (forward, backward) on the last chunk."""
    lat = acc.kernel_latency_us * 1e-6
    f, b, w = 2 * lat, 2 * lat, lat if wgrad else 0.0
    return Phase(f=f, b=b, w=w, compute=f + b + w)
