"""The CPU host-allocator policy (`accelerator.configure_host_allocator`): with "cache",
glibc serves large tensors from the heap and keeps their pages after free, so the next
step's tensors do not fault them in again; "system" leaves malloc as it is. Each case runs in
a fresh interpreter: the policy is process-wide and cannot be undone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hyperloom.accelerator import configure_host_allocator
from hyperloom.config import ConfigError, load_config

PROBE = r"""
import json, sys, resource
import torch
from hyperloom.accelerator import configure_host_allocator, _proc_status_kib
from hyperloom.planner.host_memory import _mallinfo2

applied = configure_host_allocator(sys.argv[1])
info = _mallinfo2()
mmapped = lambda: info().hblkhd
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)  # 64 MiB, above any mmap threshold
in_mmap = mmapped()
del x
rss_after_free = _proc_status_kib("VmRSS")
for step in range(4):  # "training steps": the same large tensor freed and allocated again
    if step == 2:  # steady state: the heap has found its layout
        before = faults()
    y = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(2)
    del y
refault = (faults() - before) / 2  # per step
print(json.dumps({
    "applied": applied, "in_mmap": in_mmap, "refault": refault,
    "rss_after_free_kib": rss_after_free,
}))
"""


def probe(policy: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, policy], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_cache_keeps_freed_pages_and_system_returns_them():
    cache, system = probe("cache"), probe("system")
    if cache["applied"] != "cache":
        pytest.skip("not glibc: the policy reports 'system' and changes nothing")
    assert system["applied"] == "system"
    # system: the 64 MiB block is mmapped, unmapped on free, and faulted in again every step
    # (16k pages)
    assert system["in_mmap"] >= 64 * 2**20
    assert system["refault"] > 10_000
    # cache: from the heap, kept mapped: in steady state re-allocating it faults (almost)
    # nothing
    assert cache["in_mmap"] < 64 * 2**20
    assert cache["refault"] < 1_000
    assert cache["rss_after_free_kib"] > system["rss_after_free_kib"] + 50_000


def test_bad_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="must be one of"):
        configure_host_allocator("jemalloc")
    with pytest.raises(ConfigError, match="host_allocator"):
        load_config(None, ["--train.host_allocator", "jemalloc"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_cpu_training_applies_the_policy_and_reports_it(tmp_path, tiny_job_args, cli):
    if probe("cache")["applied"] != "cache":
        pytest.skip("not glibc")
    for policy in ("cache", "system"):
        run = tmp_path / policy
        args = tiny_job_args(run, train__steps=2, train__host_allocator=policy)
        done = cli("train", *args)
        assert done.returncode == 0, done.stderr[-2000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["host_allocator"] == policy
