"""`hyperloom schedule`, driven through an argparse parser built here (the lead wires it in)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from hyperloom.pipeline import Schedule, ScheduleError, build_schedule
from hyperloom.pipeline.cli import add_schedule_parser


def run(capsys, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="hyperloom")
    sub = parser.add_subparsers(dest="command", required=True)
    add_schedule_parser(sub)
    args = parser.parse_args(["schedule", *argv])
    rc = args.func(args)
    return rc, capsys.readouterr().out


def _rows(out: str) -> dict[str, list[str]]:
    """Table rows keyed by their first cell ('0', '1', ..., 'all')."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if line.startswith("│") and cells:
            rows[cells[0]] = cells
    return rows


def test_1f1b_table_and_closed_form(capsys):
    rc, out = run(capsys, "1f1b", "--pp", "4", "--microbatches", "8")
    assert rc == 0
    rows = _rows(out)
    assert set(rows) == {"0", "1", "2", "3", "all"}
    # rank, stages, busy, bubble, bubble %, peak in-flight, act. mem, W pending, F, B, W, BW, F&B
    assert rows["0"][2:8] == ["24", "9", "27.3%", "4", "4", "0"]
    assert rows["3"][5] == "1"  # the last rank holds one activation at a time
    assert rows["0"][8:] == ["8", "0", "0", "8", "0"]
    assert rows["all"][3] == "36"
    assert "closed form (p-1)(F+B+W) = 9 (match)" in out
    assert "step time 33" in out


@pytest.mark.parametrize(
    "argv, formula",
    [
        (["zb-h1", "--pp", "4", "-m", "8"], "(p-1)(F+B-W) = 3 (match)"),
        (["interleaved", "--pp", "4", "-m", "8", "--vpp", "2"], "(p-1)(F+B+W)/v = 4.5 (match)"),
        (["dualpipe", "--pp", "8", "-m", "20"], "(PP/2-1)(F&B+B-3W) = 6 (match)"),
        (["dualpipev", "--pp", "4", "-m", "8"], "(PP/2-1)(F&B+B-3W) = 3 (match)"),
    ],
)
def test_closed_forms_printed_next_to_simulation(capsys, argv, formula):
    rc, out = run(capsys, *argv)
    assert rc == 0 and formula in out


def test_dualpipe_peak_in_flight_and_pairs(capsys):
    rc, out = run(capsys, "dualpipe", "--pp", "4", "-m", "8")
    rows = _rows(out)
    assert all(rows[str(r)][5] == "5" for r in range(4))  # PP + 1
    assert rows["all"][-1] == "12"  # F&B pairs over all ranks


def test_costs_change_the_numbers(capsys):
    rc, out = run(capsys, "1f1b", "--pp", "2", "-m", "4", "--f", "2", "--b", "1", "--w", "0.5")
    assert rc == 0 and "closed form (p-1)(F+B+W) = 3.5 (match)" in out


def test_zb_v_has_no_closed_form_but_a_number(capsys):
    rc, out = run(capsys, "zb-v", "--pp", "4", "-m", "8")
    assert rc == 0 and "simulated 1.5 (no published closed form" in out


def test_json_and_png_are_written(capsys, tmp_path):
    js, png = tmp_path / "s.json", tmp_path / "t" / "s.png"
    rc, out = run(capsys, "dualpipe", "--pp", "4", "-m", "8", "--json", str(js), "--png", str(png))
    assert rc == 0 and f"wrote {js}" in out
    d = json.loads(js.read_text())
    a = d["ranks"][0]["actions"][0]
    assert (a["kind"], a["stage"], a["microbatch"], a["start"], a["end"]) == ("F", 0, 0, 0, 1)
    assert d["loss_stages"] == [3, 7] and d["simulation"]["step_time"] == 26
    kinds = {x["kind"] for r in d["ranks"] for x in r["actions"]}
    assert {"F", "B", "W", "BW", "FB", "SEND_F", "RECV_F", "SEND_B", "RECV_B"} == kinds
    back = Schedule.from_json(js.read_text())  # simulation fields are ignored on load
    assert back.compute_only() == build_schedule("dualpipe", 4, 8)
    head = png.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_compute_only_json(capsys, tmp_path):
    js = tmp_path / "s.json"
    run(capsys, "zb-h1", "--pp", "2", "-m", "3", "--json", str(js), "--compute-only")
    back = Schedule.from_json(js.read_text())
    assert back == build_schedule("zb-h1", 2, 3)


def test_actions_listing(capsys):
    rc, out = run(capsys, "1f1b", "--pp", "2", "-m", "2", "--actions")
    assert re.search(r"rank 0: F0@s0 F1@s0 BW0@s0 BW1@s0", out)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["dualpipe", "--pp", "3", "-m", "12"], "even pp"),
        (["dualpipe", "--pp", "4", "-m", "6"], "2\\*pp"),
        (["interleaved", "--pp", "4", "-m", "6", "--vpp", "2"], "multiple of pp=4"),
        (["interleaved", "--pp", "4", "-m", "8"], "--vpp >= 2"),
        (["zb-h1", "--pp", "4", "-m", "8", "--vpp", "2"], "--vpp must be 1"),
    ],
)
def test_invalid_combinations_raise_schedule_error(capsys, argv, message):
    with pytest.raises(ScheduleError, match=message):
        run(capsys, *argv)


def test_unknown_kind_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        run(capsys, "pipedream", "--pp", "2", "-m", "2")
    assert exc.value.code == 2
