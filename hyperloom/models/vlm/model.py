"""A LLaVA-style vision-language model: vision encoder, projector and one of our decoders.

The decoder is the llama or the deepseek family's model, unchanged; this adds two modules
(`vision`, `projector`) and replaces its first step, the embedding (`embed`): the text's
token ids are embedded, each image runs through the encoder and the projector, and its
features replace the embeddings of its `tokens_per_image` placeholder tokens, image after
image in the order they appear in the batch -- row by row, left to right -- as Hugging Face's
`LlavaForConditionalGeneration` does (arXiv 2304.08485, 2310.03744). Everything after the
embedding is the decoder's: blocks, head, loss, KV cache, pipeline chunks.

The loss is each sample's mean over its labelled (answer) tokens, averaged over samples
(`loss_reduction = "sample_mean"`): a sample weighs the same whatever its answer length and
whichever micro-batch or data-parallel rank holds it, so every layout computes one loss.

Parallel layouts reach the new modules through the family's plans (`plan.py`): under tensor
parallelism the encoder and projector split their heads and hidden widths and run on whole
image sequences; the embedding runs on whole sequences too, so the merge sees every
placeholder, and under sequence parallelism `embed` then keeps this rank's slice. A pipeline
holds the encoder and projector on its first stage, which receives the micro-batch's
`ImageTokens`.
"""

from __future__ import annotations

import torch
from torch import nn

from hyperloom.config import ModelConfig
from hyperloom.config.models.vlm import tokens_per_image
from hyperloom.models.deepseek.model import DeepSeekV3
from hyperloom.models.llama.model import Llama, draw_normal, param_generator, stage_input
from hyperloom.models.vlm.inputs import ImageTokens
from hyperloom.models.vlm.vision import Projector, VisionEncoder

# The modules a vlm adds to its decoder; every other parameter is the decoder's.
VISION_MODULES = ("vision", "projector")
VISION_PREFIXES = tuple(f"{m}." for m in VISION_MODULES)


class VisionLanguage:
    """What a decoder class needs to become a vision-language model (a mixin: the decoder
    comes after it among the bases)."""

    loss_reduction = "sample_mean"

    def _add_vision(self, cfg: ModelConfig) -> None:
        self.vision: nn.Module | None = VisionEncoder(cfg)
        self.projector: nn.Module | None = Projector(cfg)
        self.tokens_per_image = tokens_per_image(cfg)
        # The embedding, encoder and projector run on whole sequences under sp (the merge
        # needs every placeholder); `embed` keeps this rank's slice afterwards.
        self.whole_sequence_modules = (
            *getattr(self, "whole_sequence_modules", ()),
            "tok_embeddings",
            *VISION_MODULES,
        )
        self.sequence = None  # sequence parallelism (tensor_parallel.SequenceShard)

    def decoder_parameters(self):
        """The parameters the decoder's init rule draws: all but the encoder's and
        projector's (`_init_vision` draws those)."""
        return ((n, p) for n, p in self.named_parameters() if not n.startswith(VISION_PREFIXES))

    def unused_parameters(self) -> list[str]:
        """Parameters no forward reaches: the encoder's blocks above the feature layer."""
        if self.vision is None:
            return []
        return [f"vision.{n}" for n in self.vision.unused_parameters()]

    def embed(self, inputs: torch.Tensor | ImageTokens, start_pos: int) -> torch.Tensor:
        """Token ids or `ImageTokens` (b, s) -> embeddings (b, s, dim) with every image's
        projected features at its placeholders; (b, s / tp, dim) under sp. A hidden state
        from an earlier pipeline stage passes through."""
        images = None
        if isinstance(inputs, ImageTokens):
            inputs, images = inputs.tokens, inputs.images
        h = stage_input(self, inputs, start_pos)
        if inputs.is_floating_point():
            return h
        slots = inputs == self.cfg.image_token_id  # (b, s)
        n_slots = slots.sum(dim=1)  # (b,)
        if images is not None or bool(n_slots.any()):
            h = self._merge_images(h, slots, n_slots, images)
        if self.sequence is not None:
            h = self.sequence.scatter(h)  # (b, s / tp, dim): this rank's slice
        return h

    def _merge_images(self, h, slots, n_slots, images) -> torch.Tensor:
        per = self.tokens_per_image
        uneven = (n_slots % per).nonzero()
        if len(uneven):
            row = int(uneven[0])
            raise ValueError(
                f"row {row} holds {int(n_slots[row])} image placeholder tokens "
                f"(id {self.cfg.image_token_id}); each image takes {per}, so the count "
                f"must be a multiple of {per}"
            )
        counts = n_slots // per  # images per row
        have = 0 if images is None else images.shape[1]
        short = (counts > have).nonzero()
        if len(short):
            row = int(short[0])
            raise ValueError(
                f"row {row} has placeholders for {int(counts[row])} image(s) but the batch "
                f"carries {have} image slot(s) per row"
            )
        # (b, max_images) -> the images in use, row by row: (n, 3, H, W)
        used = torch.arange(images.shape[1], device=counts.device)[None, :] < counts[:, None]
        pixels = images[used]
        if pixels.shape[0] == 0:
            return h
        features = self.projector(self.vision(pixels))  # (n, tokens_per_image, dim)
        # Placeholders in (row, position) order take the images' features in order.
        return h.masked_scatter(slots.unsqueeze(-1), features.to(h.dtype))

    @torch.no_grad()
    def _init_vision(self, seed: int) -> None:
        """LayerNorms one and zero, biases zero, the rest Normal(0, init_std) from their
        (seed, name) generators, as the decoder draws its own -- except the patch embedding:
        Normal(0, 1 / sqrt(3 · patch²)), a linear layer's fan-in init (timm's ViT), so patch
        features start at unit variance instead of ~0.3 at init_std."""
        std = self.cfg.init_std
        patch_std = (3 * self.cfg.patch_size**2) ** -0.5
        for prefix in VISION_MODULES:
            module = getattr(self, prefix)
            if module is None:
                continue
            norms = {n for n, m in module.named_modules() if isinstance(m, nn.LayerNorm)}
            for name, p in module.named_parameters():
                owner, _, leaf = name.rpartition(".")
                if owner in norms:
                    p.fill_(1.0 if leaf == "weight" else 0.0)
                elif leaf == "bias":
                    p.zero_()
                else:
                    wide = patch_std if name == "patch_embedding.weight" else std
                    draw_normal(p, param_generator(seed, f"{prefix}.{name}"), wide)


class LlavaLlama(VisionLanguage, Llama):
    """Vision encoder + projector + Llama decoder (LLaVA-1.5's shape with a Llama-2 decoder)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self._add_vision(cfg)

    def init_weights(self, seed: int) -> None:
        Llama.init_weights(self, seed)
        self._init_vision(seed)


class LlavaDeepSeek(VisionLanguage, DeepSeekV3):
    """Vision encoder + projector + DeepSeek-V3-style MoE decoder."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self._add_vision(cfg)

    def init_weights(self, seed: int) -> None:
        DeepSeekV3.init_weights(self, seed)
        self._init_vision(seed)


def build_vlm(cfg: ModelConfig) -> nn.Module:
    return (LlavaDeepSeek if cfg.vlm_decoder == "deepseek" else LlavaLlama)(cfg)
