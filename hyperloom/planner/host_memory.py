"""What a CPU process keeps resident beyond the bytes its tensors hold: the allocator's share.

On a GPU the planner predicts allocated bytes, and the caching allocator's reserve is the
`ALLOC_FACTOR` in `memory.py`. A CPU job is measured as resident set size (the self-check's
peak RSS), and there the C allocator decides: glibc's malloc serves tensors below its
(dynamic, up to 32 MiB) mmap threshold from heaps, and the pages of freed chunks stay
resident until the heap top can be trimmed. A training step frees and re-allocates its
activations in a different order every pass, so holes accumulate and the heap, hence the RSS,
settles well above the live bytes. Measured on this repository's 2-core container (torch
2.13, glibc): peak RSS / peak live bytes is about 1.4 for a training loop, steady after 2-3
steps, and limiting glibc to one arena did not change it.

`measure_allocator_retention` measures that factor for the runtime at hand: a fresh
interpreter runs a fixed, training-shaped loop (a small SwiGLU-transformer-like stack of
linear layers under BF16 autocast, a chunked cross-entropy over a 16k vocabulary, AdamW,
gradients set to None each step), samples glibc's live bytes (``mallinfo2``: in-use heap
chunks plus mmapped chunks) after every operator, and compares their peak with the peak RSS
(VmHWM), both above the state before the loop. `hyperloom plan calibrate` stores the ratio
as the profile's ``host_alloc_factor``; the memory model multiplies a rank's predicted peak by
it (`memory.rank_memory`). Built-in GPU profiles keep 1.0. The loop's shapes are fixed, not
the job's: the factor is taken as a property of allocator and runtime, which is what the
validation (docs/planner.md section 4) tests.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("hyperloom.planner")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2():
    """glibc's `mallinfo2`, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def live_heap_bytes() -> int | None:
    """Bytes glibc's malloc has handed out and not taken back (heap chunks in use plus mmapped
    chunks), or None without glibc."""
    info = _mallinfo2()
    if info is None:
        return None
    m = info()
    return m.uordblks + m.hblkhd


def _retention_loop(steps: int, policy: str = "cache") -> dict[str, float]:
    """The measurement itself (run in a fresh interpreter by `measure_allocator_retention`)."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from hyperloom.accelerator import (
        Accelerator,
        configure_host_allocator,
        peak_rss_bytes,
        reset_peak_rss,
    )

    applied = configure_host_allocator(policy)  # as the trainer does, before any tensor

    if live_heap_bytes() is None or not Path("/proc/self/clear_refs").exists():
        return {}
    live = live_heap_bytes

    class Sample(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Sample.peak = max(Sample.peak, live())
            return out

    torch.manual_seed(0)
    dim, ffn, layers, vocab, tokens, chunk = 384, 1024, 6, 16384, 2048, 256
    base_rss, base_live = Accelerator("cpu").current_memory_bytes(), live()
    reset_peak_rss()
    lin = torch.nn.Linear
    blocks = torch.nn.ModuleList(
        torch.nn.ModuleList(
            [
                lin(dim, 3 * dim, bias=False),
                lin(dim, dim, bias=False),
                lin(dim, 2 * ffn, bias=False),
                lin(ffn, dim, bias=False),
            ]
        )
        for _ in range(layers)
    )
    emb, head = torch.nn.Embedding(vocab, dim), lin(dim, vocab, bias=False)
    params = [*blocks.parameters(), *emb.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    with Sample():
        for _ in range(steps):
            x = emb(torch.randint(0, vocab, (tokens,)))  # (tokens, dim)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                for qkv, out, fc1, fc2 in blocks:
                    a = qkv(F.rms_norm(x, (dim,)))[:, :dim]
                    x = x + out(F.silu(a))
                    gate, up = fc1(F.rms_norm(x, (dim,))).chunk(2, -1)  # (tokens, ffn) each
                    x = x + fc2(F.silu(gate) * up)
                labels = torch.zeros(chunk, dtype=torch.long)
                loss = sum(F.cross_entropy(head(c).float(), labels) for c in x.split(chunk))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    resident = peak_rss_bytes() - base_rss
    peak_live = Sample.peak - base_live
    return {
        "steps": steps,
        "peak_live_bytes": peak_live,
        "peak_resident_bytes": resident,
        "factor": resident / peak_live if peak_live > 0 else 1.0,
        "host_allocator": applied,
    }


def in_fresh_process(call: str, args: list[str], what: str, env: dict | None = None) -> dict:
    """`print(json.dumps(call(*argv)))` in a fresh interpreter -> that dict; {} (and a warning
    naming `what`) if it fails. A fresh process is what a training run starts from: its heap,
    its pages and, on this kind of VM, its luck with huge pages."""
    module, _, name = call.rpartition(".")
    code = (
        f"import json, sys; from {module} import {name}; print(json.dumps({name}(*sys.argv[1:])))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=300,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.warning("%s not measured: %s", what, exc)
        return {}


def _retention_entry(steps: str, policy: str) -> dict[str, float]:
    return _retention_loop(int(steps), policy)


def measure_allocator_retention(steps: int = 4, policy: str = "cache") -> dict[str, float]:
    """Peak RSS over peak live bytes of a training-shaped loop in a fresh CPU process under
    the host allocator `policy` (module docstring); {} where it cannot be measured (no
    glibc, no /proc), and the factor is 1."""
    # One thread, as each rank of a multi-process CPU job runs (torchrun's OMP_NUM_THREADS).
    return in_fresh_process(
        "hyperloom.planner.host_memory._retention_entry",
        [str(steps), policy],
        "allocator retention",
        env={"OMP_NUM_THREADS": "1"},
    )
