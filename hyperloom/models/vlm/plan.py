"""Parallel plans for the vision-language family: the decoder's, plus the encoder's.

**Tensor parallelism**: the ViT blocks split like a transformer's (q, k, v and fc1
column-parallel with their biases, out_proj and fc2 row-parallel, the bias added once after
the sum); the LayerNorms, patch and position embeddings run replicated. The MLP projector
splits linear_1 by columns and linear_2 by rows; a one-linear projector runs replicated.
Encoder, projector and the token embedding are `whole_sequence_modules`: under sequence
parallelism they work on whole sequences (an image's 576 patch tokens are a small share of
the activations beside the decoder's), and the model keeps this rank's slice after the merge.

**Pipeline parallelism**: the encoder and projector sit on the first stage with the
embedding, which takes the micro-batch's `ImageTokens`; later stages are the decoder's.

**Recompute** (`tower_recompute_plans`): the policy of the decoder's blocks applies to the
encoder's blocks too, through the same module roles (core_attn, mlp_act, norm).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperloom.models.deepseek import plan as deepseek_plan
from hyperloom.models.llama import plan as llama_plan

if TYPE_CHECKING:
    from torch import nn

VISION_TP_PLAN: dict[str, str] = {
    "vision.layers.*.self_attn": "tp_input",
    "vision.layers.*.self_attn.q_proj": "colwise",
    "vision.layers.*.self_attn.k_proj": "colwise",
    "vision.layers.*.self_attn.v_proj": "colwise",
    "vision.layers.*.self_attn.out_proj": "rowwise",
    "vision.layers.*.mlp": "tp_input",
    "vision.layers.*.mlp.fc1": "colwise",
    "vision.layers.*.mlp.fc2": "rowwise",
}
PROJECTOR_TP_PLAN: dict[str, str] = {
    "projector": "tp_input",
    "projector.linear_1": "colwise",
    "projector.linear_2": "rowwise",
}

VISION_RECOMPUTE_PLAN: dict[str, list] = {
    "core_attn": ["self_attn.core_attention"],
    "mlp_act": [("mlp.act", "mlp.fc2")],
    "norm": [("layer_norm1", "self_attn"), ("layer_norm2", "mlp")],
}


def _decoder_plan(cfg):
    return deepseek_plan if cfg.vlm_decoder == "deepseek" else llama_plan


def tp_plan(cfg) -> dict[str, str]:
    projector = PROJECTOR_TP_PLAN if cfg.projector == "mlp" else {}
    return {**_decoder_plan(cfg).tp_plan(cfg), **VISION_TP_PLAN, **projector}


def recompute_plan(cfg) -> dict[str, list]:
    return _decoder_plan(cfg).recompute_plan(cfg)


def tower_recompute_plans(cfg) -> dict[str, dict[str, list]]:
    """Submodule path -> the recompute plan of its blocks (`layers`)."""
    return {"vision": VISION_RECOMPUTE_PLAN}


def pipeline_chunk(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """The decoder's cut; the encoder and projector stay on the first chunk only."""
    _decoder_plan(model.cfg).pipeline_chunk(model, layers, first, last)
    if not first:
        model.vision = None
        model.projector = None
    return model
