"""Weighted blends: which source each training sequence is drawn from.

A blend's token files hold each source's documents as one segment of the packed stream
(`Segment`: its name, token range and weight), and a sequence never crosses a segment's end.
Sequence k of the run comes from the source furthest behind its share: with the weights w
normalised to sum to one and c_s the sequences drawn from source s so far, source
argmax_s (w_s * max(k, 1) - c_s), ties to the lower index. That is Megatron-LM's rule
(`build_blending_indices` in megatron/core/datasets/helpers.cpp): deterministic, no random
draws, and the realised mix stays within two sequences of the weights at every step (tested),
so the state that resumes it exactly is the counts c_s. Within a source the sequences come in
a seeded order per epoch of that source (the loader's rule), so a source smaller than its share
is repeated, and `plan` says how many times.

Validation batches follow the same rule over the validation segments, in order (no shuffle):
the held-out loss is measured on the mix that is trained.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hyperloom.data.errors import DataError, fmt_int

logger = logging.getLogger("hyperloom.data")

SIMULATE_CAP = 1 << 22  # a plan counts at most this many draws; beyond, their fractions scale
_SOURCE_MIX = 0xBF58476D1CE4E5B9  # splitmix64's multiplier: a seed per source
_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class Segment:
    """One source's part of a packed blend: tokens [start, stop) and its weight."""

    name: str
    start: int
    stop: int
    weight: float = 1.0

    def windows(self, seq_len: int) -> int:
        """Sequences of seq_len + 1 tokens (stride seq_len) inside the segment."""
        return max(0, (self.stop - self.start - 1) // seq_len)


def source_epoch_seed(seed: int, source: int, epoch: int) -> int:
    """The seed of one source's order in one of its epochs (a fixed integer mix)."""
    return (seed * _MIX + (source + 1) * _SOURCE_MIX + epoch * 0x632BE59BD9B4E019) & _MASK63


def pick(weights: Sequence[float], counts: Sequence[int], drawn: int) -> int:
    """Megatron's blending rule: the source with the largest deficit w_s * max(k, 1) - c_s
    (sources of weight 0 never)."""
    k = max(drawn, 1)
    best, best_error = -1, 0.0
    for s, w in enumerate(weights):
        if w > 0:
            error = w * k - counts[s]
            if best < 0 or error > best_error:
                best, best_error = s, error
    return best


def blend_counts(weights: Sequence[float], n: int) -> list[int]:
    """How many of the first n draws each source gets under `pick`."""
    counts = [0] * len(weights)
    for k in range(n):
        counts[pick(weights, counts, k)] += 1
    return counts


class BlendSampler:
    """The global sequence indices of a blend's draws, in order, resumable by the counts."""

    def __init__(self, segments: Sequence[Segment], seq_len: int, seed: int, shuffle: bool):
        self.names = _unique([s.name for s in segments])
        self.tokens = [s.stop - s.start for s in segments]
        self.sizes = [s.windows(seq_len) for s in segments]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        raw = [s.weight if n > 0 else 0.0 for s, n in zip(segments, self.sizes, strict=True)]
        if sum(raw) <= 0:
            raise DataError("no source of the blend holds a whole sequence of seq_len + 1 tokens")
        self.weights = [w / sum(raw) for w in raw]
        self.seed, self.shuffle = int(seed), shuffle
        self.counts = [0] * len(segments)
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, its order)

    def _local(self, s: int, j: int) -> int:
        """Source s's j-th draw: a position in its epoch j // size's order."""
        n = self.sizes[s]
        epoch, pos = divmod(j, n)
        if not self.shuffle:
            return pos
        cached = self._orders.get(s)
        if cached is None or cached[0] != epoch:
            gen = torch.Generator().manual_seed(source_epoch_seed(self.seed, s, epoch))
            cached = (epoch, torch.randperm(n, generator=gen).numpy())
            self._orders[s] = cached
        return int(cached[1][pos])

    def take(self, n: int) -> np.ndarray:
        """The next n global sequence indices (advances the counts)."""
        out = np.empty(n, dtype=np.int64)
        for i in range(n):
            s = pick(self.weights, self.counts, sum(self.counts))
            out[i] = self.offsets[s] + self._local(s, self.counts[s])
            self.counts[s] += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sizes": list(self.sizes), "names": self.names,
                "weights": list(self.weights)}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue from saved counts; refuses a state of other sources or another seq_len."""
        if not isinstance(state, dict) or "counts" not in state:
            raise DataError(
                "the loader state has no blend counts: it was saved by a run that did not blend "
                f"these sources ({', '.join(self.names)}); resume with the same data config"
            )
        if list(state.get("sizes", [])) != self.sizes:
            raise DataError(
                f"the loader state's blend has sources of {state.get('sizes')} sequences, this "
                f"blend {self.sizes} ({', '.join(self.names)}); resume with the same sources, "
                "split and seq_len, or start afresh"
            )
        saved = [float(w) for w in state.get("weights", self.weights)]
        if not np.allclose(saved, self.weights):
            logger.warning(
                "blend weights changed since the checkpoint (%s -> %s): the mix moves towards "
                "the new weights from the counts drawn so far",
                _fmt_weights(saved),
                _fmt_weights(self.weights),
            )
        self.counts = [int(c) for c in state["counts"]]

    def plan(self, samples: int) -> dict[str, dict[str, Any]]:
        """Per source, what `samples` draws from the start make of it: the weight asked, the
        tokens it holds, its share of the training tokens and the epochs it is repeated for.
        Counted draw by draw up to SIMULATE_CAP draws; a longer run scales their shares."""
        counted = min(samples, SIMULATE_CAP)
        counts = blend_counts(self.weights, counted)
        drawn = [c * samples / counted for c in counts] if counted else [0.0] * len(counts)
        return self._rows(drawn, samples)

    def realised(self) -> dict[str, dict[str, Any]]:
        """The same rows for the draws made so far (the loader's own counts)."""
        return self._rows([float(c) for c in self.counts], sum(self.counts))

    def _rows(self, drawn: Sequence[float], total: int) -> dict[str, dict[str, Any]]:
        """Per source (by name): weight, tokens, sequences, drawn, fraction, epochs."""
        return {
            name: {
                "weight": w,
                "tokens": tokens,
                "sequences": n,
                "drawn": round(d),
                "fraction": d / total if total else 0.0,
                "epochs": d / n if n else 0.0,
            }
            for name, w, tokens, n, d in zip(
                self.names, self.weights, self.tokens, self.sizes, drawn, strict=True
            )
        }


def describe_mix(rows: dict[str, dict[str, Any]], what: str) -> str:
    """A log paragraph: one line per source."""
    lines = [f"data mix ({what}):"]
    for name, r in rows.items():
        lines.append(
            f"  {name}: weight {r['weight']:.3f}, {fmt_int(r['tokens'])} tokens, "
            f"{100 * r['fraction']:.2f}% of training tokens, {r['epochs']:.3g} epochs"
        )
    return "\n".join(lines)


def _unique(names: list[str]) -> list[str]:
    """Names made distinct by their position where two are the same."""
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def _fmt_weights(weights: Sequence[float]) -> str:
    return "[" + ", ".join(f"{w:.3f}" for w in weights) + "]"
