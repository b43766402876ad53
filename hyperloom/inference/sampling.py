"""Sampling: the checks of the sampling settings, top-k / top-p filtering, the next-token
draw and the decode budget, shared by plain and speculative decoding."""

from __future__ import annotations

import math

import torch


class GenerationError(ValueError):
    """A prompt or a sampling setting generation cannot work with; the message says why."""


def check_sampling(
    max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int = 0
) -> list[tuple[str, str]]:
    """(argument, what is wrong with it) for each argument out of range; empty if all fit."""
    out = []
    if max_new_tokens < 0:
        out.append(("max_new_tokens", f"must be >= 0, got {max_new_tokens}"))
    if not (math.isfinite(temperature) and temperature >= 0):
        out.append(("temperature", f"must be a finite number >= 0 (0 = greedy), got {temperature}"))
    if top_k < 0:
        out.append(("top_k", f"must be >= 0 (0 = off), got {top_k}"))
    if not 0 < top_p <= 1:  # top_p = 0 would keep no token at all
        out.append(("top_p", f"must lie in (0, 1] (1 = off), got {top_p}"))
    if not -(2**63) <= seed < 2**64:
        out.append(("seed", f"must fit in 64 bits, got {seed}"))
    return out


def require_sampling(
    max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int = 0
) -> None:
    """`check_sampling`, raising `GenerationError` for the first argument out of range."""
    problems = check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    if problems:
        raise GenerationError(f"{problems[0][0]} {problems[0][1]}")


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask (to -inf) all but the top-k tokens and the smallest set with mass >= top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """One token id from the last position's logits (vocab,); temperature 0 = greedy."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def decode_length(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> int:
    """Length of prompt + continuation, capped at model.max_seq_len; rejects unusable prompts."""
    if not prompt:
        raise GenerationError("the prompt encodes to zero tokens; give at least one character")
    limit = model.cfg.max_seq_len
    if len(prompt) >= limit:
        raise GenerationError(
            f"the prompt has {len(prompt)} tokens; the model's limit is {limit} "
            f"(model.max_seq_len), the continuation included: shorten the prompt"
        )
    return min(limit, len(prompt) + max_new_tokens)
