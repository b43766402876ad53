"""`model.dropout`: training-only, and p = 0 draws no random numbers (so changes no numbers).

Both families share the residual block, so both are checked: with p = 0 a training forward
leaves the global RNG untouched and equals the evaluation forward; with p > 0 a training
forward draws masks (the RNG moves, the loss changes) while evaluation is unaffected.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hyperloom.config import load_config
from hyperloom.models.registry import init_model

SMALL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.ffn_dim", "96", "--model.vocab_size", "128",
         "--model.max_seq_len", "32", "--data.seq_len", "16"]  # fmt: skip
FAMILIES = {"llama": SMALL, "deepseek": ["--model.preset", "moe-tiny", *SMALL]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dropout_acts_only_in_training_and_zero_draws_nothing(family):
    base = load_config(None, FAMILIES[family]).model
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    # The first MoE forward probes torch._grouped_mm with random inputs from the global RNG
    # (experts.grouped_mm_works, cached per process); let that happen before the RNG is watched.
    init_model(base, "cpu", seed=0).train()(x, labels=y)
    losses = {}
    for p in (0.0, 0.2):
        model = init_model(dataclasses.replace(base, dropout=p), "cpu", seed=0)
        before = torch.get_rng_state()
        with torch.no_grad():
            losses[p, "train"] = model.train()(x, labels=y)
            drew = not torch.equal(before, torch.get_rng_state())
            losses[p, "eval"] = model.eval()(x, labels=y)
        assert drew == (p > 0), p
    assert torch.equal(losses[0.0, "eval"], losses[0.2, "eval"])  # eval ignores dropout
    assert not torch.equal(losses[0.0, "train"], losses[0.2, "train"])
    if family == "llama":  # DeepSeek's training loss adds the MTP and balance terms
        assert torch.equal(losses[0.0, "train"], losses[0.0, "eval"])
