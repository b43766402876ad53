"""Hand-written Triton kernels for the fused RMSNorm(+residual) and SwiGLU operators.

The launchers take and return exactly what the torch.compile kernels they replace do
(`rmsnorm._fwd`/`_bwd`, `swiglu._fwd`/`_bwd`), so nothing above the kernel changes.
RMSNorm forward is a program per row; backward walks runs of rows per program and writes ∂w
as float32 partial rows summed afterwards (the Triton layer-norm tutorial without its lock:
deterministic). SwiGLU is elementwise. Triton is imported on first use, so this module always
imports; under `TRITON_INTERPRET=1` (set before triton is imported) the kernels run on CPU for
tests, where bf16 results may differ from torch's by one bf16 step. Not yet timed on a GPU,
so `ops.triton` is off by default.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

# `triton` and `triton.language`, bound by `_import_triton` on first use: the kernels below
# name `tl` as a global, which Triton resolves when it compiles them.
triton: Any = None
tl: Any = None

MAX_WIDTH = 65536  # RMSNorm keeps a row in one block; wider: an error, and the fused route
SWIGLU_BLOCK = 1024  # elements per SwiGLU program


# --------------------------------------------------------------------------- availability


@functools.cache
def _import_triton() -> str | None:
    """Import triton into this module's globals; the reason it cannot be, or None."""
    global triton, tl
    try:
        import triton
        import triton.language as tl
    except ModuleNotFoundError:
        return "triton is not installed (pip install triton)"
    except Exception as exc:  # noqa: BLE001 - a broken install: say how
        return f"triton does not import ({type(exc).__name__}: {exc})"
    return None


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1), on CPU tensors."""
    if _import_triton() is not None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # triton >= 3.4: the very flag triton.jit reads
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _driver_device_type() -> str | None:
    """The PyTorch device type Triton's active driver launches on ("cuda" on NVIDIA and AMD),
    or None when no Triton backend finds a device here."""
    try:
        from triton.runtime import driver

        return driver.active.get_active_torch_device().type
    except Exception:  # noqa: BLE001 - "0 active drivers" on a machine without a GPU
        return None


def unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run in this process, or None when they can."""
    if (failed := _import_triton()) is not None:
        return failed
    if not interpreting() and _driver_device_type() is None:
        return "Triton finds no GPU here and TRITON_INTERPRET=1 (the CPU interpreter) is not set"
    return None


def triton_available() -> bool:
    """True when triton imports and either a GPU Triton can launch on is present or
    TRITON_INTERPRET=1 is set."""
    return unavailable_reason() is None


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can launch on tensors living on `device`."""
    return triton_available() and (interpreting() or device.type == _driver_device_type())


@functools.cache
def _jit(fn: Callable[..., Any], interpret: bool) -> Any:
    # `interpret` only keys the cache: triton.jit reads the flag itself.
    return triton.jit(fn)


def _launch(fn: Callable[..., Any], grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    if (failed := _import_triton()) is not None:
        raise RuntimeError(failed)
    _jit(fn, interpreting())[grid](*args, **meta)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)  # the Triton tutorials' rule; not tuned (no GPU)


def _programs(device: torch.device) -> int:
    """Programs of the RMSNorm backward: one per SM on CUDA, a fixed 64 elsewhere."""
    if device.type == "cuda" and not interpreting():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 64


# --------------------------------------------------------------------------- RMSNorm


def _rmsnorm_fwd_kernel(
    X, RES, W, Y, R, RSTD, dim, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
):
    # X, RES, Y, R: (rows, dim) contiguous; W: (dim,); RSTD: (rows, 1). One row per program.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    offs = row * dim + cols
    r = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r += tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
        # The stream is stored in its own dtype and normalised from the stored value, as
        # the reference normalises `(residual + x).float()`.
        r_out = r.to(R.dtype.element_ty)
        tl.store(R + offs, r_out, mask=mask)
        r = r_out.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(r * r, axis=0) / dim + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (r * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


def _rmsnorm_bwd_kernel(
    DY,
    DR_OUT,
    R,
    W,
    RSTD,
    DR,
    DW_PARTIAL,
    n_rows,
    dim,
    rows_per_program,
    HAS_DR_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # DY, DR_OUT, R, DR: (n_rows, dim) contiguous; DW_PARTIAL: (programs, dim) float32.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    offs = first.to(tl.int64) * dim + cols  # 64-bit: tokens x dim may pass 2^31
    for row in range(first, last):
        rstd = tl.load(RSTD + row)
        xhat = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32) * rstd
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = dy * w
        dr = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / dim))
        if HAS_DR_OUT:
            dr += tl.load(DR_OUT + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DR + offs, dr, mask=mask)
        dw += dy * xhat
        offs += dim
    tl.store(DW_PARTIAL + pid.to(tl.int64) * dim + cols, dw, mask=mask)


def _row_block(dim: int) -> int:
    if dim > MAX_WIDTH:
        raise ValueError(f"Triton RMSNorm holds a row in one block: width {dim} > {MAX_WIDTH}")
    return 1 << (dim - 1).bit_length()  # the next power of two


def rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rmsnorm._fwd`: x, residual (tokens, dim) -> y, r = residual + x (r is x itself without
    a residual), rstd (tokens, 1) float32."""
    n, dim = x.shape
    block = _row_block(dim)
    x, weight = x.contiguous(), weight.contiguous()
    if residual is None:
        r = x
    else:
        residual = residual.contiguous()
        r = torch.empty(n, dim, dtype=torch.promote_types(residual.dtype, x.dtype), device=x.device)
    y = torch.empty_like(r)
    rstd = torch.empty(n, 1, dtype=torch.float32, device=x.device)
    if n:
        res = x if residual is None else residual  # an unused pointer when there is none
        meta = dict(HAS_RES=residual is not None, BLOCK=block, num_warps=_num_warps(block))
        _launch(_rmsnorm_fwd_kernel, (n,), x, res, weight, y, r, rstd, dim, eps, **meta)
    return y, r, rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    dr_out: torch.Tensor | None,
    r: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rmsnorm._bwd`: ∂r (tokens, dim) float32 (plus `dr_out`, the stream's own gradient) and
    ∂w (dim,) float32."""
    n, dim = r.shape
    block = _row_block(dim)
    dy, r, weight, rstd = dy.contiguous(), r.contiguous(), weight.contiguous(), rstd.contiguous()
    dr_out = None if dr_out is None else dr_out.contiguous()
    dr = torch.empty(n, dim, dtype=torch.float32, device=r.device)
    programs = min(n, _programs(r.device))
    if programs == 0:
        return dr, torch.zeros(dim, dtype=torch.float32, device=r.device)
    rows_per_program = _cdiv(n, programs)
    partial = torch.empty(programs, dim, dtype=torch.float32, device=r.device)  # ∂w per program
    meta = dict(HAS_DR_OUT=dr_out is not None, BLOCK=block, num_warps=_num_warps(block))
    dr_in = dy if dr_out is None else dr_out  # an unused pointer when there is none
    args = (dy, dr_in, r, weight, rstd, dr, partial, n, dim, rows_per_program)
    _launch(_rmsnorm_bwd_kernel, (programs,), *args, **meta)
    return dr, partial.sum(0)


# --------------------------------------------------------------------------- SwiGLU


def _swiglu_fwd_kernel(A, B, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    # a / (1 + 2^(-a log2 e)), log2 e = swiglu.LOG2E: swiglu._fwd's formula, so the two
    # kernels round alike.
    y = a / (1 + tl.exp2(a * -1.4426950408889634)) * b
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _swiglu_bwd_kernel(DY, A, B, DA, DB, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1 / (1 + tl.exp2(a * -1.4426950408889634))
    gs = g * s
    tl.store(DA + offs, (gs * b * (1 + a - a * s)).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (gs * a).to(DB.dtype.element_ty), mask=mask)


def _elementwise_grid(n: int) -> tuple[int]:
    return (_cdiv(n, SWIGLU_BLOCK),)


def swiglu_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`swiglu._fwd`: silu(a) · b for same-shaped a, b, in their promoted dtype."""
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    if a.numel():
        grid = _elementwise_grid(a.numel())
        _launch(_swiglu_fwd_kernel, grid, a, b, y, a.numel(), BLOCK=SWIGLU_BLOCK, num_warps=4)
    return y


def swiglu_bwd(
    dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`swiglu._bwd`: ∂a in a's dtype, ∂b in b's."""
    dy, a, b = dy.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    if a.numel():
        grid = _elementwise_grid(a.numel())
        args = (dy, a, b, da, db, a.numel())
        _launch(_swiglu_bwd_kernel, grid, *args, BLOCK=SWIGLU_BLOCK, num_warps=4)
    return da, db
