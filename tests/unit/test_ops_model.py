"""The Llama model on the fused operators vs the reference ones: same loss and gradients,
and a short training run that agrees step by step."""

from __future__ import annotations

import json

import pytest
import torch

from hyperloom.config import ModelConfig, load_config
from hyperloom.engine.ops import OpImpls
from hyperloom.models.registry import init_model
from hyperloom.train.trainer import Trainer, causal_lm_loss

CFG = ModelConfig(
    dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=80, vocab_size=97, max_seq_len=32
)


@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_and_grads_fused_vs_reference(tied):
    cfg = ModelConfig(**{**CFG.__dict__, "tie_embeddings": tied})
    model = init_model(cfg, "cpu", seed=3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 97, (3, 17), generator=g)
    labels = torch.randint(0, 97, (3, 17), generator=g)
    results = {}
    for name, impls in [
        ("reference", OpImpls.choose(fused=False)),
        ("fused", OpImpls.choose(compile=False)),
    ]:
        model.use_ops(impls).zero_grad(set_to_none=True)
        loss = model(tokens, labels=labels)
        loss.backward()
        results[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (ref_loss, ref_g), (fused_loss, fused_g) = results["reference"], results["fused"]
    torch.testing.assert_close(fused_loss, ref_loss, atol=1e-6, rtol=1e-6)
    # The logits path is unchanged and gives the same loss as the labels path.
    with torch.no_grad():
        torch.testing.assert_close(causal_lm_loss(model(tokens), labels), ref_loss)
    for name in ref_g:
        torch.testing.assert_close(fused_g[name], ref_g[name], atol=1e-5, rtol=1e-4)


def test_training_fused_on_vs_off_agree(tmp_path, tiny_job_args):
    def run(fused: bool):
        run_dir = tmp_path / f"fused_{fused}"
        args = tiny_job_args(run_dir, train__steps=8, ops__fused=fused)
        Trainer(load_config(None, args)).run()
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if r["event"] == "train"]

    on, off = run(True), run(False)
    assert len(on) == len(off) == 8
    assert on == pytest.approx(off, rel=1e-4)
