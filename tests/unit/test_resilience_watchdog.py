"""Hang watchdog (in a child process: it ends its process) and the restart-loop guard."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hyperloom.resilience.watchdog import HANG_EXIT, gave_up_reason, record_start


def test_watchdog_dumps_every_stack_and_exits(tmp_path):
    code = textwrap.dedent(
        f"""
        import threading, time
        from hyperloom.resilience.watchdog import Watchdog
        fired = []
        dog = Watchdog(0.5, {str(tmp_path)!r}, rank=3, on_fire=lambda *a: fired.append(a))
        dog.start()
        dog.heartbeat(7)
        threading.Thread(target=time.sleep, args=(60,), name="stuck-worker", daemon=True).start()
        def stuck_in_a_collective():
            time.sleep(60)
        stuck_in_a_collective()
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == HANG_EXIT, proc.stderr
    stacks = (tmp_path / "hang_rank3.txt").read_text()
    assert "after step 7" in stacks and "watchdog timeout 0.5 s" in stacks
    assert "stuck_in_a_collective" in stacks  # the main thread, where the hang is
    assert stacks.count("Thread 0x") >= 2  # every thread, not only the watchdog's


def test_a_beating_watchdog_stays_quiet(tmp_path):
    import time

    from hyperloom.resilience.watchdog import Watchdog

    dog = Watchdog(0.4, tmp_path, rank=0, on_fire=lambda *a: pytest.fail("fired"))
    dog.start()
    for step in range(6):
        time.sleep(0.1)
        dog.heartbeat(step)
    dog.stop()
    assert not (tmp_path / "hang_rank0.txt").exists()


def test_restart_guard_stops_after_restarts_without_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert record_start(tmp_path, 0, limit=2)["stalled"] == 0
    for restart, step, stalled in [(1, 4, 0), (2, 4, 1), (3, 6, 0), (4, 6, 1)]:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
        state = record_start(tmp_path, step, limit=2)
        assert (state["stalled"], state["gave_up"]) == (stalled, None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "5")
    state = record_start(tmp_path, 6, limit=2)
    assert state["stalled"] == 2
    assert "2 restarts in a row resumed from step 6" in gave_up_reason(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a new launch starts afresh
    assert record_start(tmp_path, 6, limit=2)["gave_up"] is None
    assert gave_up_reason(tmp_path) is None


@pytest.mark.parametrize("text", ['{"starts": [{"restart": 0, "st', "", "[1, 2]", '{"a": 1}'])
def test_a_torn_or_foreign_restart_record_starts_a_fresh_count(tmp_path, monkeypatch, text):
    """A restarts.json torn by a kill (or not the guard's) must not fail every restart."""
    (tmp_path / "restarts.json").write_text(text)
    assert gave_up_reason(tmp_path) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    state = record_start(tmp_path, 4, limit=2)
    assert (state["stalled"], len(state["starts"])) == (0, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["restarts.json"]  # replaced whole
