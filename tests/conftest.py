"""Shared fixtures: one data cache per test session and the tiny job every training test uses."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Triton (in the test extra) runs its kernels in its interpreter here, on CPU tensors: CI has
# no GPU. Triton reads the flag when `triton.language` is first imported, so it is set before
# anything can import that; TRITON_INTERPRET=0 in the environment opts out.
os.environ.setdefault("TRITON_INTERPRET", "1")

# A model small enough that 40 CPU steps take well under a second in fp32.
TINY_MODEL = {
    "model.dim": 64,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.ffn_dim": 128,
    "model.vocab_size": 512,
    "model.max_seq_len": 64,
}


# A vision-language job small enough for the same: vlm-tiny shrunk, on the built-in scenes
# (`tiny_job` keyword names; the encoder keeps vlm-tiny's 3 blocks, one of them unused).
TINY_VLM = {
    "model__preset": "vlm-tiny",
    "model__dim": 64,
    "model__n_layers": 2,
    "model__n_heads": 4,
    "model__n_kv_heads": 2,
    "model__ffn_dim": 128,
    "model__vision_dim": 32,
    "model__vision_heads": 2,
    "model__vision_ffn_dim": 64,
    "data__source": "scenes",
    "data__seq_len": 48,
}


@pytest.fixture(scope="session", autouse=True)
def hyperloom_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Point HYPERLOOM_CACHE at a session temp dir: the tokenizer is trained once per session.

    Set in os.environ so that `python -m hyperloom` subprocesses share the same cache.

    Torch runs single-threaded here (and in the subprocesses, through OMP_NUM_THREADS): the
    models are tiny, and on a small shared machine a second OpenMP thread waiting for a busy
    core made each matmul ~200x slower (0.2 ms -> 47 ms measured on two cores).
    """
    cache = tmp_path_factory.mktemp("hyperloom-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("HYPERLOOM_CACHE", str(cache))
    mp.setenv("OMP_NUM_THREADS", "1")
    # Fused operators run their kernels eagerly: torch.compile costs seconds per graph here,
    # and the unit tests check arithmetic (tests/unit/test_ops_compile.py compiles on purpose).
    mp.setenv("HYPERLOOM_OPS_COMPILE", "0")
    mp.delenv("WORLD_SIZE", raising=False)  # validation compares the parallel layout to it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield cache
    torch.set_num_threads(threads)
    mp.undo()


def tiny_job(run_dir: str | os.PathLike, **overrides: object) -> list[str]:
    """`--section.key value` overrides for a tiny fp32 CPU job in `run_dir`.

    Keyword names use `__` for the dot: `train__steps=12` is `--train.steps 12`.
    """
    values: dict[str, object] = {
        **TINY_MODEL,
        "data.seq_len": 64,
        "data.max_corpus_mb": 0.5,
        "data.val_fraction": 0.2,
        "train.micro_batch_size": 4,
        "train.steps": 40,
        "train.lr": 3e-3,
        "train.warmup_steps": 5,
        "train.eval_every": 0,
        "train.eval_batches": 4,
        "train.device": "cpu",
        "precision.dtype": "fp32",
        "logging.run_dir": str(run_dir),
        "logging.progress": "false",
        "logging.plot": "false",
        "logging.sample_tokens": 0,
        "logging.peak_tflops": 1,
        "logging.self_check": "off",
        "logging.log_every": 1,
    }
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    return override_args(**values)


def override_args(**overrides: object) -> list[str]:
    """`--section.key value` for each `section__key=value` (or `section.key`; bools lowercase)."""
    out: list[str] = []
    for key, value in overrides.items():
        value = str(value).lower() if isinstance(value, bool) else str(value)
        out += [f"--{key.replace('__', '.')}", value]
    return out


def run_cli(*args: str, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """`python -m hyperloom ARGS` in a subprocess (inherits HYPERLOOM_CACHE)."""
    return subprocess.run(
        [sys.executable, "-m", "hyperloom", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


@pytest.fixture(scope="session")
def tiny_job_args():
    return tiny_job


@pytest.fixture(scope="session")
def cli():
    return run_cli


def train_records(run_dir: str | os.PathLike, *args: str) -> list[dict]:
    """`python -m hyperloom train ARGS` (must succeed) -> its metrics' train records."""
    result = run_cli("train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "train"]


@pytest.fixture(scope="session")
def cli_train():
    return train_records


def launch_workers(
    worker: Path, nproc: int, *args: object, timeout: float
) -> subprocess.CompletedProcess:
    """Run `worker` with `args` under torchrun on `nproc` local processes (one plain process
    for `nproc = 1`), its output captured."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [sys.executable, *(launcher if nproc > 1 else []), str(worker), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def run_workers(worker: Path, nproc: int, *args: object, timeout: float) -> None:
    """`launch_workers`, failing the test with the tail of its stderr unless it exits 0."""
    result = launch_workers(worker, nproc, *args, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]


def train_jobs(
    out: str | os.PathLike,
    nproc: int,
    job: list[str],
    cases: list[tuple[str, list[str]]],
    timeout: float = 1200,
    shapes: bool = False,
) -> subprocess.CompletedProcess:
    """Train every case of `job` in one launch of `tests/distributed/jobs_worker.py`: under
    torchrun with `nproc` processes, or as one plain process for `nproc = 1` (as the CLI
    runs `--nproc 1`). Case NAME trains into OUT/NAME (a run dir in `job` is dropped);
    `shapes`: each rank also writes its parameters' shapes there (`jobs_worker.py`)."""
    if "--logging.run_dir" in job:
        i = job.index("--logging.run_dir")
        job = job[:i] + job[i + 2 :]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "jobs.json"
    spec.write_text(json.dumps({"out": str(out), "job": job, "cases": cases, "shapes": shapes}))
    worker = Path(__file__).parent / "distributed" / "jobs_worker.py"
    return launch_workers(worker, nproc, spec, timeout=timeout)


@pytest.fixture(scope="session")
def jobs_train():
    return train_jobs


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest):
    """The benchmark script a test module names in `BENCHMARK` (benchmarks/<name>.py), imported
    with the benchmarks folder on sys.path for its sibling imports (`machine`), taken off after."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module(request.module.BENCHMARK)
    finally:
        sys.path.remove(folder)
