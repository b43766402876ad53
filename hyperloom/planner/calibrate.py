"""`hyperloom plan calibrate`: measure the machine at hand and save an accelerator profile.

Each kernel family is measured in the form a training step runs it, not a microbenchmark's
best case: GEMMs by transformer shape in their three training forms (the best becomes the
peak, the rest ``gemm_table``); memory bandwidth as a large copy; the runtime's fused
elementwise operators against the bytes `model.build_layer` counts (``elementwise_eff``); the
host's fixed cost per layer; causal SDPA at a few sequence lengths (``attn_table``); on CPU a
training process's resident bytes beyond its live tensors (`host_memory.py`); and unless
`collectives=False`, all-reduces fitted to the ring model for bandwidth and latency (plus, on
CPU, the wait for peers). One machine has no scale-out link, so NIC figures copy the scale-up
ones: give the real NIC with --inter-gbs. On a device with SMs the GEMM shape model
(`kernels.GemmModel`) is fitted to the measured shapes, each training form timed on its own;
``--job CONFIG`` adds the job's own shapes (`calibrate_gemm.py`). The profile is a
`HardwareProfile` saved as JSON with the raw measurements; `--accelerator path.json` uses it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hyperloom.accelerator import DTYPES, configure_host_allocator
from hyperloom.accelerator import get_accelerator as get_device
from hyperloom.planner.calibrate_gemm import device_sms, gemm_forms, measure_matmuls, with_job_gemms
from hyperloom.planner.hardware import GIB, HardwareProfile, save_profile
from hyperloom.planner.host_memory import (
    RUNTIME_BATCHES,
    RuntimeMemoryProbe,
    fit_runtime_memory,
    in_fresh_process,
    standalone_env,
)

log = logging.getLogger("hyperloom.planner")


def _best_time(fn, sync, budget: float = 0.3, min_runs: int = 3) -> float:
    fn()
    sync()
    best, spent, runs = float("inf"), 0.0, 0
    while runs < min_runs or (spent < budget and runs < 100):
        start = time.perf_counter()
        fn()
        sync()
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return best


def _median_time(fn, sync, runs: int = 5, warmup: int = 3) -> float:
    """Median seconds of `runs` calls after `warmup` calls (compilation, and the allocator
    reaching the steady state a training step sees): what a step sees, not the best case."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_gemms(
    acc, dtype: torch.dtype, shapes, runs: int = 5, rounds: int = 3
) -> list[tuple[tuple[int, int, int], float]]:
    """TFLOP/s per (m, n, k) = (tokens, out, in) over a GEMM's three training forms:
    forward x (m, k) @ wᵀ, data gradient g (m, n) @ w (n, k), weight gradient gᵀ @ x.

    Each shape is timed in `rounds` rounds over all shapes (the median of `runs` calls per
    form and round), and keeps its median round: a burst of other work on the machine lands
    in one round of a few shapes, not in every run of one shape."""
    cases = []
    for m, n, k in shapes:
        x = torch.randn(m, k, device=acc.device).to(dtype)
        w = torch.randn(n, k, device=acc.device).to(dtype)
        g = torch.randn(m, n, device=acc.device).to(dtype)
        forms = (
            lambda x=x, w=w: x @ w.t(),
            lambda g=g, w=w: g @ w,
            lambda g=g, x=x: g.t() @ x,
        )
        cases.append(((m, n, k), forms))
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(rounds):
        for i, (_, forms) in enumerate(cases):
            times[i].append(sum(_median_time(f, acc.synchronize, runs) for f in forms))
    return [
        ((m, n, k), 3 * 2.0 * m * n * k / statistics.median(t) / 1e12)
        for ((m, n, k), _), t in zip(cases, times, strict=True)
    ]


def measure_memory(acc, nbytes: int) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=acc.device).fill_(1.0)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), acc.synchronize)
    return 2.0 * nbytes / t / 1e9


def measure_elementwise(
    acc, dtype: torch.dtype, tokens: int, dim: int, ffn: int, head_dim: int, runs: int = 5
) -> dict:
    """GB/s of the runtime's fused elementwise operators (forward + backward) on the bytes the
    planner's layer model charges them: 4 B per element per RMSNorm, 6 per residual add, 6 per
    SwiGLU output element, 4 per RoPE'd element, each forward, x3 for forward + backward; and
    apart from them (``cast_gbs``), an activation's cast to BF16 and back, as autocast runs
    it before each linear (eager and unfused: on CPUs slower than the fused kernels)."""
    from hyperloom.engine import ops

    dev = acc.device

    def leaf(*shape):
        return torch.randn(*shape, device=dev).to(dtype).requires_grad_(True)

    x, r, a, b = leaf(tokens, dim), leaf(tokens, dim), leaf(tokens, ffn), leaf(tokens, ffn)
    q = leaf(1, tokens, dim // head_dim, head_dim)
    weight = torch.ones(dim, device=dev, requires_grad=True)
    cos, sin = (t.to(dev) for t in ops.rope_tables(ops.rope_inv_freq(head_dim, 1e4), tokens))
    gx, ga, gq = torch.randn_like(x), torch.randn_like(a), torch.randn_like(q)

    def norm():
        y, res = ops.rms_norm(x, weight, 1e-5, r)
        torch.autograd.backward([y, res], [gx, gx])

    kernels = {
        "rmsnorm": (norm, 4.0 * tokens * dim),
        "swiglu": (lambda: ops.swiglu(a, b).backward(ga), 6.0 * tokens * ffn),
        "rope": (lambda: ops.rope(q, cos, sin).backward(gq), 4.0 * tokens * dim),
        "residual_add": (lambda: (x + r).backward(gx), 6.0 * tokens * dim),
    }
    seconds = {k: _median_time(fn, acc.synchronize, runs) for k, (fn, _) in kernels.items()}
    nbytes = {k: 3 * b for k, (_, b) in kernels.items()}
    # autocast's casts, apart: an FP32 activation to BF16 and back, 6 B per element each way
    x32 = torch.randn(tokens, dim, device=dev)
    cast_s = _median_time(lambda: x32.to(dtype).float(), acc.synchronize, runs)
    return {
        "shape": {"tokens": tokens, "dim": dim, "ffn": ffn, "head_dim": head_dim},
        "gbs": {k: nbytes[k] / seconds[k] / 1e9 for k in kernels},
        "total_gbs": sum(nbytes.values()) / sum(seconds.values()) / 1e9,
        "cast_gbs": 12.0 * tokens * dim / cast_s / 1e9,
    }


def measure_layer_overhead(acc, dtype: torch.dtype, runs: int = 31) -> float:
    """Host seconds per transformer layer per micro-batch, forward + backward, that no kernel
    accounts for: our Llama at a size where the arithmetic is negligible (dim 64, 16 tokens)
    with 1 and with 3 layers, the difference halved (embedding, head, loss and the backward's
    set-up cancel). On a GPU this is the host's launch path, on a CPU the dispatcher, autograd
    and Python between kernels.

    The two models' steps alternate and each keeps its fastest: host work only gets slower
    when something else takes the core, and timing one model after the other on a loaded
    machine can drown the difference. On a CPU the steps run on one thread: the host path is
    one thread's work anyway (these tensors are below PyTorch's parallel grain), and a second
    thread only adds its barrier, which a busy neighbour stretches."""
    from hyperloom.config import ModelConfig
    from hyperloom.models.registry import init_model

    steps = []
    for layers in (1, 3):
        cfg = ModelConfig(
            vocab_size=256, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128,
            max_seq_len=64,
        )  # fmt: skip
        model = init_model(cfg, acc.device, seed=0)
        tokens = torch.randint(0, 256, (1, 16), device=acc.device)

        def step(model=model, tokens=tokens):
            model.zero_grad(set_to_none=True)
            with acc.autocast(dtype):
                loss = model(tokens, labels=tokens)
            loss.backward()

        for _ in range(3):  # warm-up: compilation of the fused kernels, the allocator
            step()
        steps.append(step)
    best = [float("inf")] * 2
    threads = torch.get_num_threads()
    if acc.kind == "cpu":
        torch.set_num_threads(1)
    try:
        for _ in range(runs):
            for i, step in enumerate(steps):
                acc.synchronize()
                start = time.perf_counter()
                step()
                acc.synchronize()
                best[i] = min(best[i], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return max((best[1] - best[0]) / 2, 0.0)


def _elementwise_entry(device: str, dtype: str, policy: str, *shape: str) -> dict:
    """`measure_elementwise` on a fresh process's heap (see `calibrate`)."""
    if device == "cpu":
        configure_host_allocator(policy)
    dims = [int(v) for v in shape]
    return measure_elementwise(get_device(device), DTYPES[dtype], *dims, runs=11)


def measure_attention(acc, dtype: torch.dtype, seq: int, tokens: int, heads: int, dim: int):
    """(forward, backward) TFLOP/s of causal SDPA on its causal FLOPs, `tokens // seq`
    sequences of `seq`."""
    batch = max(1, tokens // seq)
    q, k, v = (
        torch.randn(batch, heads, seq, dim, device=acc.device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    go = torch.randn_like(q)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flops = 2.0 * batch * heads * seq * seq * dim  # two matmuls, causal half of 4*h*s^2*d
    tf = _median_time(lambda: sdpa(q, k, v, is_causal=True), acc.synchronize)

    def both():
        sdpa(q, k, v, is_causal=True).backward(go)

    tb = max(_median_time(both, acc.synchronize) - tf, 1e-9)
    return flops / tf / 1e12, 2.5 * flops / tb / 1e12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
IN_STEP_RUNS = 12  # per collective and size; the first two are dropped


def _collective_worker(rank: int, world: int, port: int, kind: str, sizes, out: str) -> None:
    import warnings

    import torch.distributed as dist

    # torch 2.13 renames the *_tensor collectives; they are what the runtime calls today
    warnings.filterwarnings("ignore", category=FutureWarning)
    acc = get_device(kind, rank if kind != "cpu" else 0)
    cpu = acc.kind == "cpu"
    if cpu:  # as the trainer's ranks: an even share of the cores each
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(acc.backend, rank=rank, world_size=world)
    # between the in-step calls each rank computes a few milliseconds, as a layer does
    a = torch.randn(256, 1024, device=acc.device)
    b = torch.randn(1024, 1024, device=acc.device)
    times, in_step = {}, {}
    for name in COLLECTIVES:
        times[name], in_step[name] = [], []
        for n in sizes:  # n bytes = the full buffer S of the ring model
            full = torch.ones(n // 4 // world * world, device=acc.device)
            part = torch.empty(full.numel() // world, device=acc.device)
            call = {
                "all_reduce": lambda full=full: dist.all_reduce(full),
                "reduce_scatter": lambda f=full, p=part: dist.reduce_scatter_tensor(p, f),
                "all_gather": lambda f=full, p=part: dist.all_gather_into_tensor(f, p),
            }[name]
            # A fixed number of runs: a time budget would let the ranks run different numbers
            # of collectives and mismatch them.
            call()
            best = float("inf")
            for _ in range(6):
                acc.synchronize()
                start = time.perf_counter()
                call()
                acc.synchronize()
                best = min(best, time.perf_counter() - start)
            times[name].append(best)
            if cpu:  # the mean time in the call when the ranks compute between calls
                spent = []
                for _ in range(IN_STEP_RUNS):
                    a @ b
                    start = time.perf_counter()
                    call()
                    spent.append(time.perf_counter() - start)
                in_step[name].append(statistics.fmean(spent[2:]))
    rows = [times[k] for k in COLLECTIVES] + ([in_step[k] for k in COLLECTIVES] if cpu else [])
    t = torch.tensor(rows, device=acc.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        result = dict(zip(COLLECTIVES, t[: len(COLLECTIVES)].tolist(), strict=True))
        if cpu:
            steps = t[len(COLLECTIVES) :].tolist()
            result["in_step"] = dict(zip(COLLECTIVES, steps, strict=True))
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no gloo teardown at interpreter exit (see cli._leave)


def _fit_line(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """(a, c) of t = a + c * S by least squares on relative errors (weights 1/t^2), so the
    small messages, which carry the latency, count as much."""
    w = [1.0 / t**2 for t in times]
    sw = sum(w)
    sx = sum(wi * s for wi, s in zip(w, sizes, strict=True))
    sy = sum(wi * t for wi, t in zip(w, times, strict=True))
    sxx = sum(wi * s * s for wi, s in zip(w, sizes, strict=True))
    sxy = sum(wi * s * t for wi, s, t in zip(w, sizes, times, strict=True))
    c = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return max((sy - c * sx) / sw, 0.0), c


def measure_collectives(kind: str, world: int, sizes: list[int]) -> dict:
    """All-reduce, reduce-scatter and all-gather times over `world` local ranks: the
    all-reduce fitted to the ring model (bandwidth and latency), the other two as factors on
    the ring model's bandwidth term (gloo's are no rings).

    Those come from each call's best time with the ranks idle and in step. On CPU each call is
    also timed as a training step issues it, after a few milliseconds of compute on every rank
    (`IN_STEP_RUNS`): the mean there is longer by what the first rank to arrive waits for the
    other to be scheduled and finish (the ranks share the cores). ``wait_us``, the median
    excess over every kind and size, becomes the profile's ``collective_wait_us``: on a small
    CPU it is several times a small collective's isolated time.

    The ranks are fresh interpreters (not multiprocessing children), so measuring works the
    same whatever script or module started the parent. They get an environment without the
    launcher's variables: started from a torchrun worker (the training self-check), they
    would otherwise join torchrun's rendezvous store instead of their own group and hang.
    """
    port = _free_port()
    env = standalone_env()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        code = (
            "import sys; from hyperloom.planner.calibrate import _collective_worker; "
            "_collective_worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "
            "sys.argv[4], [int(v) for v in sys.argv[5].split(',')], sys.argv[6])"
        )
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    code,
                    str(rank),
                    str(world),
                    str(port),
                    kind,
                    ",".join(map(str, sizes)),
                    out,
                ],
                env=env,
            )
            for rank in range(world)
        ]
        try:
            codes = [p.wait(timeout=120) for p in procs]
        finally:  # never leave a stuck rank behind
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise RuntimeError(f"collective benchmark ranks exited with {codes}")
        times = json.loads(Path(out).read_text())
    # all-reduce: a = 2(n-1) alpha and c = 2(n-1)/n / B; reduce-scatter and all-gather on a
    # ring would take c/2 per byte of the full buffer: their factor is how far they are off
    n = world
    a, c = _fit_line(sizes, times["all_reduce"])
    bus = 2 * (n - 1) / n / c / 1e9 if c > 0 else float("inf")
    scale = {}
    for name in COLLECTIVES[1:]:
        _, ck = _fit_line(sizes, times[name])
        scale[name] = ck / (c / 2) if c > 0 and ck > 0 else 1.0
    result = {
        "world": n,
        "sizes": sizes,
        "seconds": times,
        "busbw_gbs": bus,
        "alpha_us": a / (2 * (n - 1)) * 1e6,
        "scale": scale,
    }
    if "in_step" in times:
        # what a call waits beyond its isolated best when the ranks compute in between: the
        # median over every kind and size (the slower rank's mean, as the max above)
        waits = [
            max(0.0, mean - best)
            for name in COLLECTIVES
            for mean, best in zip(times["in_step"][name], times[name], strict=True)
        ]
        result["wait_us"] = statistics.median(waits) * 1e6
    return result


def calibrate(
    device: str = "auto",
    dtype: str = "bf16",
    quick: bool = False,
    collectives: bool = True,
    host_allocator: str = "cache",
    progress: Callable[[str], None] | None = None,
    runtime_memory: RuntimeMemoryProbe | None = None,
    gemm_shapes: list[tuple[int, int, int]] | None = None,
) -> tuple[HardwareProfile, dict]:
    """Measure this machine; returns the profile and the raw measurements. `gemm_shapes`
    (`calibrate_gemm.job_gemm_shapes`): a job's GEMM forms, timed one by one. On CPU the
    measurements run under `host_allocator` (`accelerator.configure_host_allocator`), the
    policy of the training runs the profile is for, and with every core: a CPU profile is the
    whole machine, of which a job's rank gets its share (`selfcheck.cpu_share`) -- also when
    the calibration runs inside a rank that trained with fewer threads (the training
    self-check), whose thread count is restored afterwards. `progress(text)`, if given, hears
    which measurement starts (the whole takes a minute or more on a small CPU).
    `runtime_memory` measures training runs for the host-memory fit on CPU
    (`host_memory.fit_runtime_memory`); without it that fit is left at 0."""
    args = (device, dtype, quick, collectives, host_allocator, progress, runtime_memory)
    args += (gemm_shapes,)
    if get_device(device).kind != "cpu":
        return _calibrate(*args)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or threads)
    try:
        return _calibrate(*args)
    finally:
        torch.set_num_threads(threads)


def _calibrate(
    device: str,
    dtype: str,
    quick: bool,
    collectives: bool,
    host_allocator: str,
    progress: Callable[[str], None] | None,
    runtime_memory: RuntimeMemoryProbe | None,
    gemm_shapes: list[tuple[int, int, int]] | None = None,
) -> tuple[HardwareProfile, dict]:
    """`calibrate`'s measurements, at the thread count the caller set."""
    say = progress or (lambda text: None)
    acc = get_device(device)
    cpu = acc.kind == "cpu"
    if cpu:  # the timings below allocate as training does, under the same policy
        host_allocator = configure_host_allocator(host_allocator)
    dt = DTYPES[dtype]
    # (tokens, out, in) of transformer layers: CPU at a small model's widths, GPU at 8B-70B's
    if cpu:
        tokens, widths = (512, 2048), ((384, 384), (1024, 384), (384, 1024), (4096, 1024))
        seqs, attn_shape, elem = (256, 1024, 2048), (2048, 8, 64), (2048, 1024, 2816, 64)
    else:
        tokens, widths = (4096, 16384), ((4096, 4096), (14336, 4096), (4096, 14336))
        seqs, attn_shape, elem = (1024, 4096, 8192), (16384, 32, 128), (16384, 4096, 14336, 128)
    if quick:
        tokens, seqs = tokens[-1:], seqs[::2]
    shapes = [(m, n, k) for m in tokens for n, k in widths]
    say(f"GEMMs: {len(shapes)} shapes x 3 training forms")
    gemms = measure_gemms(acc, dt, shapes)
    peak = max(t for _, t in gemms)
    say("memory bandwidth (copy)")
    mem = measure_memory(acc, (64 if cpu else 1024) * 2**20)
    say(
        "elementwise operators (fused RMSNorm, SwiGLU, RoPE, add)"
        + ("" if quick else ", 3 processes")
    )
    if quick:
        elementwise = measure_elementwise(acc, dt, *elem, runs=5)
    else:
        # Fresh processes differ more than repeats within one (each its own heap and pages):
        # the median of three processes.
        tries = [
            in_fresh_process(
                "hyperloom.planner.calibrate._elementwise_entry",
                [acc.kind, dtype, host_allocator, *map(str, elem)],
                "elementwise bandwidth",
            )
            for _ in range(3)
        ]
        tries = [t for t in tries if t] or [measure_elementwise(acc, dt, *elem, runs=11)]
        elementwise = sorted(tries, key=lambda t: t["total_gbs"])[len(tries) // 2]
        elementwise["processes"] = [t["total_gbs"] for t in tries]
    say(f"attention at sequence lengths {', '.join(map(str, seqs))}")
    attn = [(q, *measure_attention(acc, dt, q, *attn_shape)) for q in seqs]
    say("host overhead per layer")
    layer_overhead = measure_layer_overhead(acc, dt)
    attn_f, attn_b = attn[len(attn) // 2][1:]  # the middle length, for tables-unaware readers
    if cpu:
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
        world = 2
    else:
        mod = getattr(torch, acc.kind)
        capacity = mod.get_device_properties(acc.index).total_memory / GIB
        world = mod.device_count()
    raw = {
        "device": acc.describe(),
        "dtype": dtype,
        "gemm_tflops": [{"m": s[0], "n": s[1], "k": s[2], "tflops": t} for s, t in gemms],
        "memory_gbs": mem,
        "elementwise": elementwise,
        "layer_overhead_s": layer_overhead,
        "attention_tflops": [{"seq": q, "forward": f, "backward": b} for q, f, b in attn],
    }
    host_fixed, host_churn = 0.0, 0.0
    if cpu and runtime_memory is not None:
        say(f"resident memory of a training process (micro-batches {RUNTIME_BATCHES})")
        fit = fit_runtime_memory([runtime_memory(b, host_allocator) for b in RUNTIME_BATCHES])
        raw["runtime_memory"] = fit
        if fit:
            host_fixed, host_churn = fit["fixed_bytes"], fit["churn_factor"]
    link = {"intra_gbs": 0.0, "intra_latency_us": 0.0}
    wait_us = 0.0
    coll_scale: tuple[tuple[str, float], ...] = ()
    if collectives and world > 1:
        sizes = [2**p for p in (range(12, 25, 4) if quick else range(10, 27, 2))]
        say(f"all-reduce, reduce-scatter, all-gather over {world} ranks")
        coll = measure_collectives(acc.kind, world, sizes)
        raw["all_reduce"] = coll
        link = {"intra_gbs": coll["busbw_gbs"], "intra_latency_us": coll["alpha_us"]}
        wait_us = coll.get("wait_us", 0.0)
        coll_scale = tuple(sorted(coll["scale"].items()))
    profile = HardwareProfile(
        name=f"calibrated-{acc.kind}",
        bf16_tflops=peak,
        fp8_tflops=0.0,
        hbm_gib=capacity,
        hbm_gbs=mem,
        gemm_eff=1.0,
        attn_fwd_eff=min(1.0, attn_f / peak),
        attn_bwd_eff=min(1.0, attn_b / peak),
        mem_eff=1.0,
        intra_gbs=link["intra_gbs"] or 1.0,
        intra_eff=1.0,
        intra_latency_us=link["intra_latency_us"],
        nic_gbs=link["intra_gbs"] or 1.0,
        inter_eff=1.0,
        inter_latency_us=link["intra_latency_us"],
        gpus_per_node=world,
        host_runtime_bytes=host_fixed,
        host_churn_factor=host_churn,
        source=f"measured by `hyperloom plan calibrate` on {acc.describe()} ({dtype})",
        gemm_table=tuple((s, t / peak) for s, t in gemms),
        elementwise_eff=min(1.0, elementwise["total_gbs"] / mem),
        cast_eff=min(1.0, elementwise["cast_gbs"] / mem),
        attn_table=tuple((q, min(1.0, f / peak), min(1.0, b / peak)) for q, f, b in attn),
        collective_scale=coll_scale,
        layer_overhead_s=layer_overhead,
        collective_wait_us=wait_us,
    )
    sms = device_sms(acc)
    forms = list(gemm_shapes or [])
    if sms:  # every default shape's forms too: the model is fitted on each form alone
        forms = list(dict.fromkeys(forms + [f for m, n, k in shapes for f in gemm_forms(m, n, k)]))
    if forms:
        say(f"GEMMs one form at a time: {len(forms)} shapes" + (f", {sms} SMs" if sms else ""))
        measured = measure_matmuls(acc, dt, forms)
        raw["gemm_forms_tflops"] = [
            {"m": m, "n": n, "k": k, "tflops": t} for (m, n, k), t in measured
        ]
        profile = with_job_gemms(profile, measured, sms)
    return profile, raw


def _job_shapes(args: argparse.Namespace) -> list[tuple[int, int, int]] | None:
    """``--job CONFIG`` (and its dotted overrides): the job's GEMM forms, or None."""
    if not getattr(args, "job", None):
        return None
    from hyperloom.planner.calibrate_gemm import job_gemm_shapes
    from hyperloom.planner.cli import load_job

    return job_gemm_shapes(load_job(args.job, list(getattr(args, "overrides", []) or [])))


def cmd_calibrate(args: argparse.Namespace, runtime_memory: RuntimeMemoryProbe | None) -> int:
    """`hyperloom plan calibrate`: measure, save the profile to ``--out``, print a summary."""
    from rich.console import Console

    console = Console()
    with console.status("calibrating") as status:

        def progress(text: str) -> None:
            status.update(f"calibrating: {text}")
            console.log(text)

        profile, raw = calibrate(
            dtype=getattr(args, "dtype", "bf16"),
            quick=args.quick,
            host_allocator=args.host_allocator,
            progress=progress,
            runtime_memory=runtime_memory,
            gemm_shapes=_job_shapes(args),
        )
    path = save_profile(profile, args.out, raw)
    console.print(
        f"{raw['device']}: GEMM peak {profile.bf16_tflops:.3f} TFLOP/s, memory "
        f"{profile.hbm_gbs:.1f} GB/s (elementwise kernels {profile.elementwise_eff:.0%} of it), "
        f"attention {profile.attn_fwd_eff:.0%}/"
        f"{profile.attn_bwd_eff:.0%} of peak, all-reduce "
        f"{profile.intra_gbs:.2f} GB/s bus, {profile.intra_latency_us:.1f} us/step"
        + (
            f", host process {profile.host_runtime_bytes / 1e6:.0f} MB"
            f" + {profile.host_churn_factor:.2f} x what a step churns"
            if profile.host_runtime_bytes or profile.host_churn_factor
            else ""
        )
        + f" -> {path}"
    )
    return 0
