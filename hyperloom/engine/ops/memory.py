"""Count the bytes that PyTorch ops allocate, on any device (including CPU and meta).

The CPU allocator keeps no peak statistics, and RSS mixes in the interpreter and cached pages.
`AllocationTracker` is a `TorchDispatchMode` that counts each op output's new storages until
they are freed, and reports the peak of live bytes and the largest single allocation -- how
the tests prove the chunked cross-entropy never materialises the whole logits. On the meta
device it measures memory without computing anything.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationTracker(TorchDispatchMode):
    """`with AllocationTracker() as t: ...` then `t.peak_bytes`, `t.largest_bytes`."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0
        self._live: dict[int, int] = {}  # storage id (its C pointer) -> bytes

    def _free(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in seen or key in self._live:
                continue
            nbytes = storage.nbytes()
            self._live[key] = nbytes
            weakref.finalize(storage, self._free, key)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.largest_bytes = max(self.largest_bytes, nbytes)
        return out
