"""benchmarks/fp8_convergence.py's bookkeeping, without training: the command line each contender
runs, which flags make two runs the same run (so a finished one is reused only when it is), and
that a run stopped early (`--stop-at`) is not taken for a finished one."""

from __future__ import annotations

import json

import pytest

BENCHMARK = "fp8_convergence"  # the conftest `bench` fixture imports it


def flag(cmd: list[str], name: str) -> str | None:
    """The value after `name` in a command line (None when absent)."""
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_schedule_flags_reach_every_contender(bench, tmp_path):
    args = bench.parse(["--warmup-steps", "100", "--lr", "0.002", "--stop-at", "300"])
    for recipe in ("bf16", "blockwise-qk", "current"):
        cmd = bench.train_command(recipe, tmp_path / recipe, args)
        assert flag(cmd, "--train.warmup_steps") == "100"
        assert flag(cmd, "--train.lr") == "0.002"
        assert flag(cmd, "--train.stop_at_step") == "300"
        assert flag(cmd, "--train.steps") == "1000"  # the schedule still plans all the steps
    qk = bench.train_command("blockwise-qk", tmp_path / "qk", args)
    assert flag(qk, "--precision.fp8") == "blockwise"
    assert {"*.wq", "*.wk"} <= set(json.loads(flag(qk, "--precision.fp8_keep")))
    plain = bench.train_command("bf16", tmp_path / "bf16", bench.parse([]))
    assert flag(plain, "--precision.fp8") == "none"
    for name in ("--train.lr", "--train.stop_at_step"):
        assert name not in plain  # the job's own peak; no stop
    # the job's warmup (30 of 300 steps) stretched to the benchmark's steps
    assert flag(plain, "--train.warmup_steps") == "100"
    short = bench.train_command("bf16", tmp_path / "short", bench.parse(["--steps", "600"]))
    assert flag(short, "--train.warmup_steps") == "60"


def test_settings_name_the_schedule(bench):
    base = bench.settings(bench.parse([]))
    assert base["warmup_steps"] == 100 and "lr" not in base  # lr: older run dirs stay reusable
    changed = bench.settings(bench.parse(["--warmup-steps", "30", "--lr", "0.002"]))
    assert changed["warmup_steps"] == 30 and changed["lr"] == 0.002
    # the stretched default and the same warmup asked for are one run
    assert bench.settings(bench.parse(["--warmup-steps", "100"])) == base
    # stopping early is no setting: the same run goes on later without it
    assert bench.settings(bench.parse(["--stop-at", "300"])) == base


def write_run(run_dir, last: int, every: int = 100) -> None:
    run_dir.mkdir(parents=True)
    lines = [
        {"event": "train", "step": s, "loss": 5.0, "tokens_per_s": 1e3}
        for s in range(5, last + 1, 5)
    ]
    lines += [{"event": "eval", "step": s, "val_loss": 5.0} for s in range(0, last + 1, every)]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    (run_dir / "summary.json").write_text(json.dumps({"steps": last, "final_val_loss": 5.0}))


def test_a_run_stopped_early_is_not_finished(bench, tmp_path):
    write_run(tmp_path / "stopped", last=300)
    stopped = bench.collect(tmp_path / "stopped", steps=1000)
    assert stopped["last_step"] == 300 and not stopped["finished"]
    assert stopped["train_loss_last_10pct"] is None
    write_run(tmp_path / "done", last=1000)
    done = bench.collect(tmp_path / "done", steps=1000)
    assert done["finished"] and done["train_loss_last_10pct"] == 5.0


def test_collect_without_bf16_reports_no_noise_floor(bench, tmp_path, capsys):
    """A BF16 repeat collected on its own (its BF16 run still going) has nothing to drift from:
    the summary says so instead of failing, and reports a floor once BF16 is there."""
    write_run(tmp_path / "bf16-refops", last=1000)
    common = ["--collect", "--run-root", str(tmp_path), "--plot", str(tmp_path / "p.png")]
    bench.main([*common, "--recipes", "bf16-refops", "--json", str(tmp_path / "alone.json")])
    alone = json.loads((tmp_path / "alone.json").read_text())
    assert alone["bf16_noise_floor_pct"] is None and alone["bf16_repeat_final_drift_pct"] is None
    assert "BF16 repeat" not in capsys.readouterr().out
    write_run(tmp_path / "bf16", last=1000)
    bench.main([*common, "--recipes", "bf16,bf16-refops", "--json", str(tmp_path / "pair.json")])
    pair = json.loads((tmp_path / "pair.json").read_text())
    assert pair["bf16_noise_floor_pct"] == 0.0 and pair["bf16_repeat_final_drift_pct"] == 0.0
    assert "the BF16 repeat (rounding points only) ends 0.00%" in capsys.readouterr().out


def test_combine_refuses_to_mix_schedules(bench, tmp_path):
    """The collected JSON records the warmup and peak it ran; seeds run under other schedules
    are not averaged (a JSON from before the record ran the job's 30 steps and 3e-3)."""
    for name in ("bf16", "blockwise"):
        write_run(tmp_path / name, last=1000)
    common = ["--collect", "--run-root", str(tmp_path), "--recipes", "bf16,blockwise"]
    paths = {}
    for seed, extra in ((1, []), (2, []), (3, ["--warmup-steps", "30"])):
        paths[seed] = tmp_path / f"s{seed}.json"
        argv = [*common, *extra, "--seed", str(seed), "--json", str(paths[seed])]
        bench.main([*argv, "--plot", str(tmp_path / f"s{seed}.png")])
    recorded = json.loads(paths[1].read_text())
    assert (recorded["warmup_steps"], recorded["lr"]) == (100, 3e-3)
    both = bench.combine([paths[1], paths[2]], tmp_path / "ok.json", 0.5)
    assert both["warmup_steps"] == 100 and both["verdict"]["blockwise"]["within"]
    with pytest.raises(SystemExit, match="differ in warmup_steps"):
        bench.combine([paths[1], paths[3]], tmp_path / "mixed.json", 0.5)
    older = json.loads(paths[3].read_text())
    del older["warmup_steps"], older["lr"]  # as written before the schedule was recorded
    paths[4] = tmp_path / "older.json"
    paths[4].write_text(json.dumps({**older, "seed": 4}))
    assert bench.combine([paths[3], paths[4]], tmp_path / "w30.json", 0.5)["warmup_steps"] == 30
    with pytest.raises(SystemExit, match="differ in warmup_steps"):
        bench.combine([paths[1], paths[4]], tmp_path / "mixed2.json", 0.5)
