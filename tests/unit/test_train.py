"""Tests for hyperloom.train: LR schedules, a real (tiny) training run, exact resume, clipping.

Every run is the tiny fp32 job of conftest.tiny_job on 0.5 MB of the stdlib corpus; 40 steps
take well under a second on two CPU cores, so the runs are shared through module fixtures
only to keep the suite quick, not because they are slow.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hyperloom.checkpoint import list_checkpoints
from hyperloom.config import JobConfig, TrainConfig, load_config
from hyperloom.data import DataError, ResumableLoader
from hyperloom.models.llama import param_count, training_flops_per_token
from hyperloom.models.registry import init_model
from hyperloom.train.optim import lr_at
from hyperloom.train.trainer import Trainer, causal_lm_loss

LN_VOCAB = math.log(512)  # cross-entropy of a uniform prediction over the tiny vocabulary

# Measured on the 40-step fp32 run (seed 1234): initial validation loss 6.238 (= ln 512),
# final 5.180, a drop of 1.06 nats; bf16 reaches 5.180 as well. A model that has not
# learned stays at ~6.24, so requiring a drop of 0.5 leaves a 2x margin either way.
MIN_VAL_DROP = 0.5


def job(run_dir: Path, tiny_job_args, **overrides) -> JobConfig:
    return load_config(None, tiny_job_args(run_dir, **overrides))


def read_metrics(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


# --------------------------------------------------------------------------- LR schedules

BASE = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_warmup_is_linear(schedule):
    cfg = dataclasses.replace(BASE, schedule=schedule)
    warm = [lr_at(s, cfg) for s in range(10)]
    assert warm == pytest.approx([(s + 1) / 10 for s in range(10)], abs=1e-12)
    assert warm[-1] == pytest.approx(1.0)


def test_cosine_decays_to_the_floor_at_the_last_step():
    cfg = dataclasses.replace(BASE, schedule="cosine")
    lrs = [lr_at(s, cfg) for s in range(10, 100)]  # after warmup
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))
    # A half cosine from peak to floor: lr = floor + (peak - floor) (1 + cos(pi x)) / 2 with
    # the progress x advancing by the same amount every step.
    x = [math.acos(max(-1.0, min(1.0, 2 * (lr - 0.1) / 0.9 - 1))) / math.pi for lr in lrs]
    increments = [b - a for a, b in zip(x, x[1:], strict=False)]
    assert max(increments) - min(increments) < 1e-6
    assert x[0] <= 1 / 89 + 1e-9  # starts at (or one step below) the peak
    # The last optimizer step (steps - 1) runs at min_lr_ratio * lr.
    assert lrs[-1] == pytest.approx(0.1, abs=1e-9)
    assert lr_at(150, cfg) == pytest.approx(0.1)  # and it stays there


def test_wsd_is_flat_then_decays_linearly_to_the_floor():
    cfg = dataclasses.replace(BASE, schedule="wsd", decay_fraction=0.2)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[10:80] == [1.0] * 70  # stable phase: exactly the peak
    decay = lrs[80:]
    steps = [a - b for a, b in zip(decay, decay[1:], strict=False)]
    assert steps == pytest.approx([0.9 / 20] * 19, abs=1e-12)  # linear
    assert decay[0] == pytest.approx(1.0 - 0.9 / 20)
    assert decay[-1] == pytest.approx(0.1, abs=1e-12)
    assert lr_at(120, cfg) == pytest.approx(0.1)


def test_constant_stays_at_peak():
    cfg = dataclasses.replace(BASE, schedule="constant")
    assert {lr_at(s, cfg) for s in range(10, 100)} == {1.0}
    assert lr_at(10**6, cfg) == 1.0
    no_warmup = dataclasses.replace(BASE, schedule="cosine", warmup_steps=0)
    assert lr_at(0, no_warmup) == 1.0


# --------------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_job_args):
    run_dir = tmp_path_factory.mktemp("run") / "fp32"
    cfg = job(run_dir, tiny_job_args, train__eval_every=20, logging__plot=True)
    return cfg, Trainer(cfg).run()


def test_training_lowers_validation_loss(trained):
    _, result = trained
    s = result.summary
    assert s["initial_val_loss"] == pytest.approx(LN_VOCAB, abs=0.05)
    assert s["final_val_loss"] < s["initial_val_loss"] - MIN_VAL_DROP
    assert s["final_train_loss"] < s["initial_val_loss"] - MIN_VAL_DROP


def test_metrics_jsonl(trained):
    cfg, result = trained
    train = read_metrics(result.run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, 41))  # log_every 1
    flops = training_flops_per_token(cfg.model, 64)
    for r in train:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(r)
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, cfg.train), rel=1e-12)
        # peak_tflops = 1: MFU is model FLOP/s over 1e12.
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / 1e12, rel=1e-9)
    assert train[-1]["loss"] < train[0]["loss"] - MIN_VAL_DROP
    evals = read_metrics(result.run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 20, 40]
    assert evals[0]["val_loss"] == result.summary["initial_val_loss"]
    assert evals[-1]["val_loss"] == result.summary["final_val_loss"]


def test_validation_in_bits_per_byte(trained):
    """Every validation is also reported in bits per byte: the loss over ln 2 and over the
    UTF-8 bytes per token of exactly the batches it was measured on."""
    from hyperloom.data import build_data, val_batches

    cfg, result = trained
    data = build_data(cfg.data, cfg.model.vocab_size)
    rows = val_batches(
        data.val, cfg.train.micro_batch_size, cfg.data.seq_len, cfg.train.eval_batches
    )
    labels = torch.cat([y for _, y in rows])  # (batches x rows, seq)
    nbytes = sum(len(data.tokenizer.decode(r).encode()) for r in labels.tolist())
    per_token = nbytes / labels.numel()
    assert 1.0 < per_token < 4.0  # the 512-token BPE: a few bytes per token
    for r in read_metrics(result.run_dir, "eval"):
        assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2) / per_token, rel=1e-9)
    s = result.summary
    assert s["final_val_bpb"] == pytest.approx(s["final_val_loss"] / math.log(2) / per_token)
    assert s["initial_val_bpb"] > s["final_val_bpb"]


def test_summary_and_run_dir_contents(trained):
    cfg, result = trained
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary == result.summary
    for key in ("final_train_loss", "final_val_loss", "tokens_per_s", "wall_time_s"):
        assert isinstance(summary[key], float) and summary[key] > 0, key
    # 2 * (64*64*2 + 64*32*2 + 3*64*128) + 2*64 + 64 + 2 * 512*64
    assert summary["parameters"] == param_count(cfg.model) == 139_584
    assert (summary["steps"], summary["steps_this_run"]) == (40, 40)
    assert summary["tokens_seen"] == 40 * 4 * 64
    png = result.run_dir / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert load_config(result.run_dir / "config.toml") == cfg
    ckpts = list_checkpoints(result.run_dir)
    assert [p.name for p in ckpts] == ["step_00000040"]
    assert summary["checkpoint"] == str(ckpts[0])
    meta = json.loads((ckpts[0] / "meta.json").read_text())
    assert meta["step"] == 40 and meta["tokens_seen"] == 10240
    assert set(meta["sha256"]) == {
        "model.safetensors",
        "train_state.pt",
        "config.toml",
        "tokenizer.json",
    }


def test_no_plot_when_disabled(tmp_path, tiny_job_args):
    result = Trainer(job(tmp_path / "r", tiny_job_args, train__steps=2)).run()
    assert not (result.run_dir / "loss_curve.png").exists()
    assert (result.run_dir / "summary.json").is_file()


def test_mfu_uses_the_measured_peak(tmp_path, tiny_job_args):
    cfg = job(tmp_path / "r", tiny_job_args, train__steps=3, logging__peak_tflops=0)
    s = Trainer(cfg).run().summary
    assert 0 < s["peak_tflops"] < 1e4  # the measured CPU matmul peak, not the 0 placeholder
    flops = training_flops_per_token(cfg.model, 64)
    assert s["mfu"] == pytest.approx(s["tokens_per_s"] * flops / (s["peak_tflops"] * 1e12))
    assert 0 < s["mfu"] < 1


def test_bf16_trains_like_fp32(tmp_path, tiny_job_args, trained):
    cfg = job(tmp_path / "bf16", tiny_job_args, precision__dtype="bf16")
    s = Trainer(cfg).run().summary
    assert s["dtype"] == "bf16"
    assert all(math.isfinite(r["loss"]) for r in read_metrics(tmp_path / "bf16", "train"))
    assert s["final_val_loss"] < s["initial_val_loss"] - MIN_VAL_DROP
    # Same data and seed: bf16 compute ends close to fp32 (measured difference 4e-4).
    assert s["final_val_loss"] == pytest.approx(trained[1].summary["final_val_loss"], abs=0.05)


# --------------------------------------------------------------------------- exact resume

N, M = 6, 6


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory, tiny_job_args):
    """A: N+M steps straight; B: stop at N, then the same command again (resume=auto)."""
    root = tmp_path_factory.mktemp("resume")
    common = dict(train__steps=N + M, train__grad_accum=2, train__warmup_steps=3)
    a = root / "a"
    Trainer(job(a, tiny_job_args, **common)).run()
    b = root / "b"
    first = Trainer(job(b, tiny_job_args, train__stop_at_step=N, **common)).run()
    half = root / "half"  # B after its first half, kept for the negative controls
    shutil.copytree(b, half)
    second = Trainer(job(b, tiny_job_args, **common)).run()  # checkpoint.resume = auto
    return {"a": a, "b": b, "half": half, "first": first, "second": second, "common": common}


def test_stop_at_step_saves_and_stops(resume_runs):
    first = resume_runs["first"].summary
    assert (first["steps"], first["steps_this_run"]) == (N, N)
    assert [p.name for p in list_checkpoints(resume_runs["half"])] == [f"step_{N:08d}"]


def test_rerun_at_stop_step_trains_nothing(resume_runs, tiny_job_args, tmp_path):
    run = tmp_path / "again"
    shutil.copytree(resume_runs["half"], run)
    cfg = job(run, tiny_job_args, train__stop_at_step=N, **resume_runs["common"])
    s = Trainer(cfg).run().summary
    assert (s["steps"], s["steps_this_run"]) == (N, 0)
    assert s["checkpoint"] == str(run / "checkpoints" / f"step_{N:08d}")


def test_resume_continues_bit_for_bit(resume_runs):
    second = resume_runs["second"].summary
    assert (second["steps"], second["steps_this_run"]) == (N + M, M)
    assert second["initial_val_loss"] is None  # no fresh start
    la, lb = _losses(resume_runs["a"]), _losses(resume_runs["b"])
    assert sorted(la) == sorted(lb) == list(range(1, N + M + 1))
    for step in range(1, N + M + 1):
        assert lb[step] == la[step], step  # exact, not approximate
    wa, wb = _weights(resume_runs["a"], N + M), _weights(resume_runs["b"], N + M)
    assert list(wa) == list(wb)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_resume_without_loader_state_diverges(resume_runs, tiny_job_args, monkeypatch, tmp_path):
    """Negative control: the test above would be vacuous if the data order did not matter."""
    run = tmp_path / "c"
    shutil.copytree(resume_runs["half"], run)
    monkeypatch.setattr(ResumableLoader, "load_state_dict", lambda self, state: None)
    Trainer(job(run, tiny_job_args, **resume_runs["common"])).run()
    la, lc = _losses(resume_runs["a"]), _losses(run)
    assert all(lc[s] == la[s] for s in range(1, N + 1))  # the copied first half
    assert all(lc[s] != la[s] for s in range(N + 1, N + M + 1))
    wa, wc = _weights(resume_runs["a"], N + M), _weights(run, N + M)
    assert not torch.equal(wa["tok_embeddings.weight"], wc["tok_embeddings.weight"])


def test_resume_with_a_different_seed_is_refused(resume_runs, tiny_job_args, tmp_path):
    run = tmp_path / "d"
    shutil.copytree(resume_runs["half"], run)
    cfg = job(run, tiny_job_args, train__seed=99, **resume_runs["common"])
    with pytest.raises(DataError, match="saved seed=1234, this loader has seed=99"):
        Trainer(cfg).run()


# --------------------------------------------------------------------------- clipping


def test_optimizer_steps_on_clipped_gradients(tmp_path, tiny_job_args):
    """One AdamW step on a gradient clipped to norm 1e-3, recomputed by hand.

    Adam's first step is lr * g / (|g| + eps) per element, blind to the gradient's scale when
    |g| >> eps. With eps = 1e-5 and elements of the clipped gradient around 3e-6 the update
    is nearly proportional to g, so clipped and unclipped updates differ visibly.
    """
    clip, lr, eps, wd = 1e-3, 3e-3, 1e-5, 0.1
    cfg = job(
        tmp_path / "clip",
        tiny_job_args,
        train__grad_clip=clip,
        train__eps=eps,
        train__weight_decay=wd,
        train__warmup_steps=0,
        train__schedule="constant",
    )
    trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    loader_state = trainer.loader.state_dict()
    _, grad_norm = trainer.train_step()
    after = dict(trainer.model.named_parameters())

    # The same step by hand: same init, same batch, plain autograd.
    model = init_model(cfg.model, "cpu", cfg.train.seed)
    loader = ResumableLoader(trainer.data.train, 4, 64, seed=cfg.train.seed)
    loader.load_state_dict(loader_state)
    inputs, labels = loader.next_batch()
    causal_lm_loss(model(inputs), labels).backward()
    params = dict(model.named_parameters())
    for n, p in params.items():
        assert torch.equal(p.detach(), before[n]), n
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params.values()]))
    assert grad_norm.item() == pytest.approx(norm.item(), rel=1e-5)  # the pre-clip norm
    assert norm.item() > 100 * clip  # so clipping really scales the gradient down
    scale = clip / (norm.item() + 1e-6)  # torch.nn.utils.clip_grad_norm_

    def adamw_first_step(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        decay = wd if p.ndim >= 2 else 0.0  # norms are not decayed
        return p * (1 - lr * decay) - lr * g / (g.abs() + eps)

    worst_clipped = worst_unclipped = 0.0
    for n, p in params.items():
        got = after[n].detach()
        clipped = adamw_first_step(before[n], p.grad * scale)
        unclipped = adamw_first_step(before[n], p.grad)
        worst_clipped = max(worst_clipped, (got - clipped).abs().max().item())
        worst_unclipped = max(worst_unclipped, (got - unclipped).abs().max().item())
    assert worst_clipped < 1e-7
    assert worst_unclipped > 1e-4


def test_grad_accum_averages_micro_batches(tmp_path, tiny_job_args):
    """Loss and gradient of a 2-micro-batch step are the means over the micro-batches."""
    cfg = job(tmp_path / "accum", tiny_job_args, train__grad_accum=2, train__grad_clip=0)
    trainer = Trainer(cfg)
    loader_state = trainer.loader.state_dict()
    loss, grad_norm = trainer.train_step()

    model = init_model(cfg.model, "cpu", cfg.train.seed)
    loader = ResumableLoader(trainer.data.train, 4, 64, seed=cfg.train.seed)
    loader.load_state_dict(loader_state)
    losses = []
    for _ in range(2):
        inputs, labels = loader.next_batch()
        micro = causal_lm_loss(model(inputs), labels)
        (micro / 2).backward()
        losses.append(micro.item())
    assert losses[0] != losses[1]
    assert loss.item() == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(LN_VOCAB, abs=0.05)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert grad_norm.item() == pytest.approx(norm.item(), rel=1e-5)
    assert loader.state_dict() == trainer.loader.state_dict()  # both consumed two batches


# --------------------------------------------------------------------------- checkpoints


def test_periodic_checkpoints_are_pruned_to_keep(tmp_path, tiny_job_args):
    cfg = job(
        tmp_path / "r", tiny_job_args, train__steps=10, checkpoint__every=3, checkpoint__keep=2
    )
    Trainer(cfg).run()
    # Saved at 3, 6, 9 and at the end (10); only the newest two remain, no .tmp leftovers.
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == [
        "step_00000009",
        "step_00000010",
    ]


def test_corrupted_checkpoint_is_refused(trained, tmp_path):
    from hyperloom.checkpoint import CheckpointError
    from hyperloom.inference import load_for_inference

    _, result = trained
    ckpt = tmp_path / "step_00000040"
    shutil.copytree(list_checkpoints(result.run_dir)[-1], ckpt)
    loaded = load_for_inference(ckpt, device="cpu")
    assert loaded.checkpoint == ckpt and loaded.cfg == trained[0]
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors does not match its SHA-256"):
        load_for_inference(ckpt, device="cpu")


def test_self_check_puts_the_planner_beside_the_measurement(tmp_path, tiny_job_args):
    """With a profile, the summary carries predicted and measured step time and memory."""
    from hyperloom.planner.hardware import get_profile, save_profile

    profile = save_profile(get_profile("h100"), tmp_path / "h100.json")
    cfg = job(tmp_path / "r", tiny_job_args, train__steps=2, logging__self_check=str(profile))
    s = Trainer(cfg).run().summary
    assert s["plan_profile"] == "h100"
    assert 0 < s["predicted_step_s"] < s["measured_step_s"]  # an H100 beats two CPU cores
    assert s["step_time_error"] == pytest.approx(s["predicted_step_s"] / s["measured_step_s"] - 1)
    assert s["predicted_peak_memory_gb"] > 0 and s["measured_peak_memory_gb"] > 0
    parts = s["predicted_memory_gib_by_part"]
    assert parts["params"] > 0 and parts["optimizer"] == pytest.approx(2 * parts["params"])
    saved = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert saved["predicted_step_s"] == s["predicted_step_s"]


def test_self_check_with_a_missing_profile_warns_and_trains(tmp_path, tiny_job_args):
    cfg = job(tmp_path / "r", tiny_job_args, train__steps=1, logging__self_check="nope.json")
    s = Trainer(cfg).run().summary
    assert "nope.json" in s["plan_error"] and s["steps"] == 1
