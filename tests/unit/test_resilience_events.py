"""Logs that a killed run leaves with a torn last line: metrics.jsonl and events.log are
appended to by the resumed run without losing a complete line, and read without failing."""

from __future__ import annotations

import json
import logging

from hyperloom.resilience.events import EventLog, json_events, read_jsonl, repair_tail
from hyperloom.train.report import Reporter

GOOD = '{"event": "train", "step": 1, "loss": 4.0}\n{"event": "anomaly", "step": 2}\n'
TORN = '{"event": "train", "step": 3, "lo'


def test_repair_tail_cuts_only_the_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(GOOD + TORN)
    assert repair_tail(path) == len(TORN)
    assert path.read_text() == GOOD
    assert repair_tail(path) == 0 and path.read_text() == GOOD  # a sound file is left alone
    path.write_text(TORN)  # nothing complete at all
    assert repair_tail(path) == len(TORN) and path.read_text() == ""
    assert repair_tail(tmp_path / "missing.jsonl") == 0


def test_read_jsonl_passes_over_lines_that_are_not_records(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text(GOOD + TORN + '\n{"event": "eval", "step": 4}\n[1]\n\n\xff\n')
    with caplog.at_level(logging.WARNING, "hyperloom.resilience"):
        records = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2, 4]
    assert "passed over 3 line(s)" in caplog.text and "line 3, 5, 7" in caplog.text
    assert [r["event"] for r in json_events(tmp_path)] == ["anomaly"]


def test_a_resumed_reporter_appends_after_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(GOOD + TORN)
    reporter = Reporter(tmp_path, 10, progress=False, append=True)
    assert [r["step"] for r in reporter.history] == [1, 2]
    reporter.eval_metrics(3, 3.5)
    reporter.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_an_event_after_a_torn_events_log_line_starts_its_own(tmp_path):
    (tmp_path / "events.log").write_text("2026-01-01 00:00:00 step 2 [skip] ok\n2026-01-01 00:")
    EventLog(tmp_path).emit("restart", "restart 1: resumed", step=2)
    lines = (tmp_path / "events.log").read_text().splitlines()
    assert lines[0] == "2026-01-01 00:00:00 step 2 [skip] ok"
    assert len(lines) == 2 and lines[1].endswith("step 2 [restart] restart 1: resumed")


def test_train_resumes_after_a_torn_metrics_line(tmp_path, tiny_job_args, cli):
    """The run was killed mid-write: the resume must not fail on metrics.jsonl."""
    run = tmp_path / "run"
    job = tiny_job_args(run, train__steps=6, checkpoint__every=2)
    first = cli("train", *job, "--train.stop_at_step", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    kept = (run / "metrics.jsonl").read_text()
    with (run / "metrics.jsonl").open("a") as f:
        f.write(TORN)
    proc = cli("train", *job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (run / "metrics.jsonl").read_text()
    assert text.startswith(kept)  # every complete line kept
    records = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2, 3, 4, 5, 6]
