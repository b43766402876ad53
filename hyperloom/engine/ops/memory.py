"""Count the bytes that PyTorch ops allocate, on any device (including CPU and meta).

CUDA has `max_memory_allocated`; the CPU allocator keeps no such statistics, and the process's
peak RSS mixes in the interpreter and freed-but-cached pages. `AllocationTracker` is a
`TorchDispatchMode` that sees every op's outputs: a storage no input of the op shares is a
new allocation, counted until its Python storage object is freed (PyTorch keeps that object
alive as long as any tensor uses the storage). It reports the peak of live bytes above what
existed before, and the largest single allocation -- which is how the tests prove that the
chunked cross-entropy never materialises the (tokens, vocab) logits. On the meta device it
measures a shape's memory without computing anything.
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
