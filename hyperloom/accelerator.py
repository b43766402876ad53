"""The device layer: which device, which collective backend, and the few device calls we need.

Everything else in hyperloom asks this module instead of naming a device type, so a vendor
accelerator that PyTorch exposes as a device module (`torch.musa`, `torch.xpu`, `torch.npu`,
...) works by name. Collective backends follow each vendor's PyTorch plugin: NCCL on CUDA
(and ROCm, which PyTorch also calls "cuda"), MCCL on MUSA, XCCL on XPU, HCCL on Ascend NPU and
Gaudi HPU, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("hyperloom.accelerator")

BACKENDS = {
    "cpu": "gloo",
    "cuda": "nccl",
    "musa": "mccl",
    "xpu": "xccl",
    "npu": "hccl",
    "hpu": "hccl",
    "mps": "gloo",
}
_AUTO_ORDER = ("cuda", "musa", "xpu", "npu", "hpu", "mps")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


class AcceleratorError(RuntimeError):
    """The requested device is unknown or not available here."""


def _module(kind: str):
    """PyTorch's device module for `kind` (torch.cuda, torch.musa, ...) or None."""
    return getattr(torch, kind, None) if kind != "cpu" else None


def _available(kind: str) -> bool:
    if kind == "cpu":
        return True
    mod = _module(kind)
    try:
        return bool(mod is not None and mod.is_available())
    except Exception:  # a half-installed vendor plugin must not break CPU runs
        return False


@dataclass(frozen=True)
class Accelerator:
    """One device type and its collective backend."""

    kind: str
    index: int = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, self.index)

    @property
    def backend(self) -> str:
        return BACKENDS.get(self.kind, "gloo")

    def synchronize(self) -> None:
        mod = _module(self.kind)
        if mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()

    def autocast(self, dtype: torch.dtype):
        """Mixed-precision region; a no-op for fp32."""
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.kind, dtype=dtype)

    def reset_peak_memory(self) -> None:
        mod = _module(self.kind)
        if mod is not None and hasattr(mod, "reset_peak_memory_stats"):
            mod.reset_peak_memory_stats(self.index)
        elif self.kind == "cpu":
            reset_peak_rss()

    def peak_memory_bytes(self) -> int:
        """Peak allocated device memory; on CPU the process's peak resident set size since
        start or since `reset_peak_memory`."""
        mod = _module(self.kind)
        if mod is not None and hasattr(mod, "max_memory_allocated"):
            return int(mod.max_memory_allocated(self.index))
        return peak_rss_bytes()

    def peak_memory_measures(self) -> str:
        """What `peak_memory_bytes` measures here, for reports that name their figure."""
        mod = _module(self.kind)
        if mod is not None and hasattr(mod, "max_memory_allocated"):
            return f"{self.kind} memory allocated by tensors"
        return "process resident set (RSS)"

    def current_memory_bytes(self) -> int:
        """Allocated device memory now; on CPU the process's resident set size."""
        mod = _module(self.kind)
        if mod is not None and hasattr(mod, "memory_allocated"):
            return int(mod.memory_allocated(self.index))
        return _proc_status_kib("VmRSS") * 1024 or peak_rss_bytes()

    def memory_capacity_bytes(self) -> int:
        """The memory a process on this device may use: the device's total; on CPU what the
        host has available now plus what this process already holds (cgroup limit included)."""
        mod = _module(self.kind)
        if mod is not None and hasattr(mod, "get_device_properties"):
            return int(mod.get_device_properties(self.index).total_memory)
        return host_memory_available() + self.current_memory_bytes()

    def rng_state(self) -> torch.Tensor | None:
        mod = _module(self.kind)
        if mod is not None and hasattr(mod, "get_rng_state"):
            return mod.get_rng_state(self.index)
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        mod = _module(self.kind)
        if state is not None and mod is not None and hasattr(mod, "set_rng_state"):
            mod.set_rng_state(state, self.index)

    def describe(self) -> str:
        if self.kind == "cpu":
            return f"cpu ({torch.get_num_threads()} threads)"
        mod = _module(self.kind)
        name = mod.get_device_name(self.index) if hasattr(mod, "get_device_name") else self.kind
        return f"{self.kind}:{self.index} ({name})"


def get_accelerator(name: str = "auto", index: int = 0) -> Accelerator:
    """Resolve `train.device`: "auto" picks the first available accelerator, else the CPU."""
    if name == "auto":
        kind = next((k for k in _AUTO_ORDER if _available(k)), "cpu")
        return Accelerator(kind, index)
    kind, _, idx = name.partition(":")
    if kind not in BACKENDS and _module(kind) is None:
        raise AcceleratorError(
            f"unknown device '{name}'; use auto, cpu or a PyTorch device type such as "
            f"{', '.join(k for k in BACKENDS if k != 'cpu')}"
        )
    if not _available(kind):
        raise AcceleratorError(
            f"device '{kind}' is not available on this machine (torch {torch.__version__}); "
            f"use train.device = auto or cpu"
        )
    return Accelerator(kind, int(idx) if idx else index)


@functools.cache
def measure_matmul_tflops(kind: str, dtype_name: str, size: int = 0) -> float:
    """Best achieved TFLOP/s of a square matmul on this device: the MFU denominator by default.

    A measured peak keeps MFU honest on machines without a datasheet number (a CPU, a new
    accelerator); pass `logging.peak_tflops` to use a datasheet figure instead.
    """
    acc = Accelerator(kind)
    dtype = DTYPES[dtype_name]
    n = size or (1024 if kind == "cpu" else 8192)
    a = torch.randn(n, n, device=acc.device).to(dtype)
    b = torch.randn(n, n, device=acc.device).to(dtype)
    for _ in range(2):
        a @ b  # warm-up (kernel selection, caches)
    acc.synchronize()
    # Best of many runs over about half a second: on a shared machine a single timing
    # mostly measures the neighbours.
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 5 or (spent < 0.5 and runs < 200):
        start = time.perf_counter()
        a @ b
        acc.synchronize()
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    tflops = 2 * n**3 / best / 1e12
    log.info("measured %s %s matmul peak: %.2f TFLOP/s (n=%d)", kind, dtype_name, tflops, n)
    return tflops


def norm_accumulator(device: torch.device) -> torch.dtype:
    """dtype for summing squared gradients: float64 wherever the device has it (not MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


NORM_SLICE = 1 << 16  # elements per float32 partial norm in `sum_of_squares`


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of every element's square over `tensors`, a `norm_accumulator` scalar.

    Float32 tensors: float32 norms of `NORM_SLICE`-element slices, squared and summed in
    float64; other dtypes: norms with a float64 accumulator. Asking `_foreach_norm` for a
    float64 accumulator on float32 tensors materialises a float64 copy of each whole tensor
    on CPU: 12.9 ms against 5.3 ms this way, for random tensors shaped like the default
    model's gradients. A float32 norm of a whole 6M-element tensor is off by ~2e-4 relative,
    enough to make layouts disagree with one process; over 64K-element slices the sum was off
    by 3.5e-7 (against float64 throughout, on those tensors)."""
    acc = norm_accumulator(device)
    total = torch.zeros((), device=device, dtype=acc)
    f32 = [s for t in tensors if t.dtype == torch.float32 for s in t.reshape(-1).split(NORM_SLICE)]
    if f32:
        total = total + torch.stack(torch._foreach_norm(f32, 2.0)).to(acc).square().sum()
    other = [t for t in tensors if t.dtype != torch.float32]  # low precision: half the copy
    if other:
        total = total + torch.stack(torch._foreach_norm(other, 2.0, dtype=acc)).square().sum()
    return total


def _proc_status_kib(field: str) -> int:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return 0
    return int(match.group(1)) if match else 0


def host_memory_available() -> int:
    """Bytes the host can still give this process: /proc/meminfo's MemAvailable, capped by a
    cgroup v2 memory limit less its usage."""
    try:
        info = Path("/proc/meminfo").read_text()
        match = re.search(r"^MemAvailable:\s+(\d+) kB", info, re.M)
        free = int(match.group(1)) * 1024 if match else 0
    except OSError:
        free = 0
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            free = min(free, max(0, int(limit) - used)) if free else max(0, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark to its current RSS (Linux >= 4.0); False if refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started or since `reset_peak_rss`.

    Read from /proc/self/status (VmHWM), not `getrusage`: a spawned worker's `ru_maxrss` keeps
    the RSS its parent had when it forked (Linux carries it across exec), which would charge
    the parent's memory to every worker; and only VmHWM can be reset.
    """
    kib = _proc_status_kib("VmHWM")
    if kib:
        return kib * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


# ------------------------------------------------------------------ host (CPU) allocator
HOST_ALLOCATORS = ("cache", "system")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc <malloc.h>
_host_allocator: str | None = None  # what this process applied, once


def configure_host_allocator(policy: str = "cache") -> str:
    """Make the C allocator keep freed memory for reuse, as a device caching allocator does.

    On CPU, glibc serves large blocks with a fresh `mmap` and returns them on free, so every
    training step faults its activations' pages in again (benchmarks/README.md). Like Intel's
    launcher swapping in jemalloc, we keep the memory, but through two glibc knobs: no mmap
    for large blocks (``M_MMAP_MAX`` = 0) and no heap trimming below 2 GiB of free top
    (``M_TRIM_THRESHOLD``). The heap keeps its high-water mark (peak RSS: docs/ops.md); the
    planner's calibrated ``host_alloc_factor`` is measured under the same policy.

    ``policy``: "cache" (the default for CPU training) or "system" (leave malloc as it is).
    Returns the policy in effect: "system" where the C library is not glibc (musl, macOS) or
    refused. Process-wide and not undone: once "cache" is in effect, "system" reports it.
    """
    global _host_allocator
    if policy not in HOST_ALLOCATORS:
        raise ValueError(f"host allocator policy must be one of {HOST_ALLOCATORS}, got {policy!r}")
    if _host_allocator is not None or policy == "system":
        return _host_allocator or "system"
    applied = "system"
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL("libc.so.6")
            # glibc only (other C libraries lack these knobs or give them other numbers)
            ok = hasattr(libc, "gnu_get_libc_version") and libc.mallopt(_M_MMAP_MAX, 0) == 1
            ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
            applied = "cache" if ok else "system"
        except (OSError, AttributeError):
            pass
        if applied != "cache":
            log.info("host allocator left as is: glibc's mallopt is unavailable here")
    _host_allocator = applied
    return applied
