"""Parallel plans for the DeepSeek family: none yet.

Tensor, pipeline and expert parallelism of MoE/MLA models are not built; config validation
rejects tp, pp and ep > 1 for this family before a model is built, so these are never used.
"""

from torch import nn

TP_PLAN: dict[str, str] = {}


def pipeline_chunk(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    raise NotImplementedError(
        "pipeline parallelism for the deepseek family is not built yet (MTP needs the "
        "embedding on the last stage)"
    )
