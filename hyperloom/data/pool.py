"""Tokenizer worker processes: chunks of texts in, token streams out, in the order sent.

`in_order` runs the chunks a build produces through `workers` processes and yields their
results in submission order, whatever order the workers finish in, so what is appended to the
token files does not depend on the number of workers. At most 2 x workers chunks are in flight
(a pool's `imap` would read the whole input ahead), which bounds the memory. Chunks that are
already tokens (Megatron documents) pass through the same queue and keep their place.

Workers are forked where the platform allows (Linux; spawned elsewhere) and hold only the
tokenizer, rebuilt from its JSON: one HF `tokenizers` thread each (TOKENIZERS_PARALLELISM=false
is set for them, which also keeps the library from warning about the fork). With one worker
the chunks are tokenized in this process, on the library's own thread pool.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from hyperloom.data.tokenizer import Tokenizer, pack, token_dtype

_PARALLELISM = "TOKENIZERS_PARALLELISM"
Chunk = tuple[list[str], list[bool]]  # texts, and whether each is a validation document


def resolve_workers(workers: int) -> int:
    """`data.workers`, 0 meaning min(usable cores, 8)."""
    if workers > 0:
        return workers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 8))


def encode_chunk(tok: Tokenizer, payload: Chunk) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of texts -> its (train, val) token streams, each document followed by eos."""
    texts, is_val = payload
    ids = tok.encode_batch(texts)
    dtype = token_dtype(tok.vocab_size)
    train = [x for x, v in zip(ids, is_val, strict=True) if not v]
    val = [x for x, v in zip(ids, is_val, strict=True) if v]
    return pack(train, tok.eos_id, dtype), pack(val, tok.eos_id, dtype)


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer_json: str, eos_token: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = Tokenizer(HFTokenizer.from_str(tokenizer_json), eos_token)


def _encode_in_worker(payload: Chunk) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    return encode_chunk(_WORKER_TOKENIZER, payload)


class _Done:
    """A result computed here, in the queue beside the pool's pending ones."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value


def in_order(items: Iterator, tok: Tokenizer, workers: int) -> Iterator:
    """(source, (train, val), bytes) for each (source, kind, payload, bytes) item, in the
    order given: "text" payloads (a `Chunk`) are tokenized, "tokens" ones passed through."""
    pool = _start_pool(tok, workers) if workers > 1 else None
    pending: deque = deque()
    try:
        for s, kind, payload, nbytes in items:
            if kind == "tokens":
                result: Any = _Done(payload)
            elif pool is None:
                result = _Done(encode_chunk(tok, payload))
            else:
                result = pool.apply_async(_encode_in_worker, (payload,))
            pending.append((s, result, nbytes))
            while len(pending) > 2 * workers - 1 or (pool is None and pending):
                s0, r, n = pending.popleft()
                yield s0, r.get(), n
        while pending:
            s0, r, n = pending.popleft()
            yield s0, r.get(), n
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()


def _start_pool(tok: Tokenizer, workers: int) -> Any:
    """A pool of `workers` processes, each holding a copy of `tok`."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    saved = os.environ.get(_PARALLELISM)
    os.environ[_PARALLELISM] = "false"  # the children inherit it: one tokenizer thread each
    try:
        return mp.get_context(method).Pool(
            workers, initializer=_init_worker, initargs=(tok.backend.to_str(), tok.eos_token)
        )
    finally:
        if saved is None:
            del os.environ[_PARALLELISM]
        else:
            os.environ[_PARALLELISM] = saved
