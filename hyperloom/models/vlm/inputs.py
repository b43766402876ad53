"""The input of a vision-language model: token ids with image placeholders, and the images.

`ImageTokens` travels where a tensor of token ids travels in the text-only families: the
loader yields it as the `inputs` of an (inputs, labels) batch, the trainer moves it to the
device and takes its data-parallel rows, the pipeline cuts it into micro-batches and hands
each to the first stage. So it offers the few tensor methods those paths use (`to`, row
indexing, `chunk`, `is_floating_point`), each applied to both tensors along the batch
dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ImageTokens:
    """tokens (batch, seq) int64, where each image is `tokens_per_image` consecutive ids equal
    to `model.image_token_id`; images (batch, max_images, 3, H, W) float, row b's first k
    slots holding its k images in the order they appear in the text (the rest are unused)."""

    tokens: torch.Tensor
    images: torch.Tensor

    def is_floating_point(self) -> bool:  # not a hidden state (`llama.model.stage_input`)
        return False

    def to(self, device, non_blocking: bool = False) -> ImageTokens:
        return ImageTokens(
            self.tokens.to(device, non_blocking=non_blocking),
            self.images.to(device, non_blocking=non_blocking),
        )

    def __getitem__(self, rows) -> ImageTokens:
        return ImageTokens(self.tokens[rows], self.images[rows])

    def chunk(self, n: int) -> tuple[ImageTokens, ...]:
        return tuple(
            ImageTokens(t, i)
            for t, i in zip(self.tokens.chunk(n), self.images.chunk(n), strict=True)
        )
