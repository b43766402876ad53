"""Speculative decoding with the multi-token-prediction modules as the draft model.

A DeepSeek-V3 model trained with D MTP modules (arXiv 2412.19437 §2.2) carries a cheap draft
model: module k reads the main model's hidden state at i and Emb(t_{i+k}) and predicts
t_{i+k+1}; V3 §5.4.3 reports the second token accepted 85-90% of the time, 1.8x decoding
speed. Each round: **draft** d₁..d_D through the module chain (each module keeps its own MLA
cache), **verify** [t_{i+1}, d₁, ..., d_D] in one main-model forward, **accept** drafts left
to right (the first rejected one is replaced by a corrected token; if all pass, a bonus
token), so a forward yields 1 to D + 1 tokens, and **roll back** by moving the position
counter, since caches are written at explicit positions.

Acceptance (Leviathan et al., arXiv 2211.17192; Chen et al., arXiv 2302.01318): a draft
x ~ q is accepted with probability min(1, p(x) / q(x)), else the token is drawn from
norm(max(0, p - q)), which makes the output distributed exactly as p. p and q are what
`generate` samples from (temperature, top-k, top-p applied to both), so speculative sampling
draws from the plain sampler's distribution; greedy decoding accepts a draft iff it is the
verifier's argmax, giving plain greedy's tokens up to rounding. Batch size 1 only; a poorly
trained draft costs speed, never correctness (`Stats` has the numbers).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from hyperloom.accelerator import Accelerator
from hyperloom.inference.sampling import decode_length, filter_logits, require_sampling
from hyperloom.models.deepseek.mla import MLACache


@dataclass
class Stats:
    """What one speculative `generate` call measured."""

    drafted: int = 0  # draft tokens proposed to the verifier
    accepted: int = 0  # of those, accepted
    forwards: int = 0  # main-model forwards, the prompt's (prefill) included
    new_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.forwards if self.forwards else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_forward": self.tokens_per_forward,
        }


@dataclass
class Sampler:
    """The target distribution of `hyperloom.inference.sample_next`, as probabilities."""

    temperature: float
    top_k: int
    top_p: float
    gen: torch.Generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(vocab,) logits -> float32 probabilities on CPU; one-hot on the argmax if greedy."""
        if self.temperature <= 0:
            return F.one_hot(logits.argmax().cpu(), logits.shape[-1]).float()
        scaled = filter_logits(logits.float() / self.temperature, self.top_k, self.top_p)
        return scaled.softmax(dim=-1).cpu()

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.gen))


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p / q) per token (vocab,), 0 where q is 0 (such a draft is never proposed)."""
    return torch.where(q > 0, (p / q.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(p))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where a rejected draft's replacement is drawn from."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    # Empty only when p == q, where nothing is rejected; p then keeps the call well defined.
    return r / total if total > 0 else p


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor, token: int, gen: torch.Generator
) -> tuple[bool, int]:
    """The speculative-sampling step for a draft `token` ~ q: (accepted, token to emit)."""
    u = float(torch.rand((), generator=gen))
    if u < float(acceptance_probability(p, q)[token]):
        return True, token
    return False, int(torch.multinomial(residual_distribution(p, q), 1, generator=gen))


class Drafter(Protocol):
    """A draft model for `generate`: sees the main model's hidden states, proposes tokens."""

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """Main-model last-layer states (1, n, dim) of positions start .. start + n - 1."""

    def propose(
        self, tokens: list[int], n: int, sampler: Sampler
    ) -> list[tuple[int, torch.Tensor | None]]:
        """n draft tokens to follow `tokens`, each with its draft distribution q (None: the
        draft is deterministic, q is one-hot on it)."""


class MTPDrafter:
    """The model's D MTP modules, chained (module doc, step 1), over their own cache layers."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: MLACache | None,
        max_len: int,
        acc: Accelerator,
        dtype: torch.dtype,
    ):
        self.model, self.cache, self.acc, self.dtype = model, cache, acc, dtype
        self.depth = len(model.mtp)
        self.max_len = max_len
        self.hidden: torch.Tensor | None = None  # (1, max_len, dim) main hidden states
        self.done = 0  # main positions covered by the last proposal

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        if self.hidden is None:  # in the dtype the forward produced (autocast)
            self.hidden = hidden.new_zeros(1, self.max_len, hidden.shape[2])
        self.hidden[:, start : start + hidden.shape[1]] = hidden

    def propose(
        self, tokens: list[int], n: int, sampler: Sampler
    ) -> list[tuple[int, torch.Tensor | None]]:
        end = len(tokens) - 1  # main positions [0, end) have hidden states
        # Module k's entries from position done - (k - 1) on were built from drafts (doc, step 4).
        start = max(0, self.done - (self.depth - 1)) if self.cache is not None else 0
        ids, h, out = list(tokens), self.hidden[:, start:end], []  # h: (1, end - start, dim)
        for k, module in enumerate(self.model.mtp.values()):
            # Module k + 1 at position j reads token j + k + 1 (a draft for the last k).
            x = torch.tensor([ids[start + k + 1 : end + k + 1]], device=self.acc.device)
            cos, sin = self.model.rope_cos[start:], self.model.rope_sin[start:]
            with self.acc.autocast(self.dtype):
                h = module(
                    module.merge(self.model.tok_embeddings(x), h), cos, sin, self.cache, start
                )
                logits = self.model._head(module.norm(h[:, -1]))  # (1, vocab)
            q = sampler.probs(logits[0])
            ids.append(sampler.draw(q))
            out.append((ids[-1], q))
        self.done = end
        return out[:n]


@contextmanager
def _last_hidden(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collects the input of the model's final norm — the last layer's output h⁰, what the MTP
    modules read — on every forward, leaving the model's code untouched."""
    seen: list[torch.Tensor] = []
    handle = model.norm.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    try:
        yield seen
    finally:
        handle.remove()


def _verify(
    logits: torch.Tensor, drafts: list[tuple[int, torch.Tensor | None]], sampler: Sampler
) -> tuple[list[int], int]:
    """logits (len(drafts) + 1, vocab) of the verify forward -> (new tokens, drafts accepted)."""
    out = []
    for j, (token, q) in enumerate(drafts):
        p = sampler.probs(logits[j])
        q = q if q is not None else F.one_hot(torch.tensor(token), p.shape[-1]).float()
        ok, emitted = accept_or_resample(p, q, token, sampler.gen)
        out.append(emitted)
        if not ok:
            return out, j
    out.append(sampler.draw(sampler.probs(logits[-1])))  # the bonus token
    return out, len(drafts)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 1.0,
    eos_id: int | None = None,
    use_cache: bool = True,
    seed: int = 0,
    acc: Accelerator | None = None,
    dtype: torch.dtype = torch.float32,
    drafter: Drafter | None = None,
) -> tuple[list[int], Stats]:
    """`hyperloom.inference.generate` with MTP drafts verified by the main model; returns the
    new tokens and the `Stats`. `drafter` replaces the MTP modules (tests use one)."""
    depth = len(getattr(model, "mtp", ()))
    if depth == 0:
        raise ValueError("speculative decoding drafts with the MTP modules; the model has none")
    require_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    acc = acc or Accelerator("cpu")
    total = decode_length(model, prompt, max_new_tokens)
    model.eval()
    sampler = Sampler(temperature, top_k, top_p, torch.Generator().manual_seed(seed))
    cache = None
    if use_cache:  # main layers, then one layer per MTP module
        cache = MLACache.allocate(
            model.cfg, model.cfg.n_layers + depth, 1, total, acc.device, dtype
        )
    drafter = drafter or MTPDrafter(model, cache, total, acc, dtype)
    stats, tokens, pos, drafts = Stats(), list(prompt), 0, []
    with _last_hidden(model) as seen:
        while len(tokens) < total:
            start = pos if use_cache else 0
            x = torch.tensor([tokens[start:] + [t for t, _ in drafts]], device=acc.device)
            with acc.autocast(dtype):
                logits = model(x, cache=cache, start_pos=start)  # (1, s, vocab)
            stats.forwards += 1
            new, accepted = _verify(logits[0, -len(drafts) - 1 :], drafts, sampler)
            stats.drafted, stats.accepted = stats.drafted + len(drafts), stats.accepted + accepted
            tokens += new
            if eos_id is not None and eos_id in new:
                del tokens[len(tokens) - len(new) + new.index(eos_id) + 1 :]
                break
            # Positions [start, pos) had committed inputs; their states feed the draft.
            pos = len(tokens) - 1
            drafter.observe(seen.pop()[:, : pos - start], start)
            n = min(depth, total - len(tokens) - 1)  # a round yields at most n + 1 tokens
            drafts = drafter.propose(tokens, n, sampler) if n > 0 else []
    stats.new_tokens = len(tokens) - len(prompt)
    return tokens[len(prompt) :], stats
