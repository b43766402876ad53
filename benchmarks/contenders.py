"""The three contenders of the training benchmarks, built to train the same thing.

hyperloom, plain PyTorch (`plain_llama.py`) and Hugging Face `transformers` get the same model
shape, the same initial weights (hyperloom's, loaded by name into the other two), the same
random token batches and the same step: forward under autocast (or plain FP32), FP32
cross-entropy, backward, global-norm clipping, AdamW with decay on matrices only, zero_grad.

- hyperloom runs a real `Trainer`, whose `train_step` is called as is; only its loader is
  swapped for an in-memory one, so the data pipeline is not part of what is measured.
- plain and hf are stepped by `reference_step`, the same arithmetic written in plain torch.
  For hf the loss is computed from `.logits` (no `labels=`): HF's `ForCausalLMLoss` shifts the
  labels itself, so passing ours would train on different targets, while its cost would be the
  same (an FP32 upcast of the logits, then `cross_entropy`). `use_cache=False`, as in any HF
  training loop.

`check_parity` is the proof that the three compute the same function: their FP32 losses on the
first batch from the same weights must agree within `PARITY_TOL`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from plain_llama import PlainLlama  # benchmarks/ is on sys.path (scripts run from there)
from torch import nn

from hyperloom.accelerator import DTYPES, Accelerator
from hyperloom.config import (
    DataConfig,
    JobConfig,
    ModelConfig,
    OpsConfig,
    PrecisionConfig,
    TrainConfig,
)
from hyperloom.train.optim import lr_at

CONTENDERS = ("hyperloom", "plain", "hf")
PARITY_TOL = 1e-4  # max |loss difference| at init in FP32: summation order only


@dataclass(frozen=True)
class Spec:
    """Everything a worker process needs to rebuild its contender and the batches."""

    model: ModelConfig
    dtype: str
    micro_batch: int
    seq_len: int
    warmup: int
    steps: int
    threads: int
    device: str
    seed: int = 1234
    ops: OpsConfig = OpsConfig()  # hyperloom's operators (fused by default)
    # On CPU: glibc's policy for large blocks (`accelerator.configure_host_allocator`), set in
    # the worker before anything is built. None: each contender's own (hyperloom's trainer
    # sets "cache", the plain and HF loops leave malloc as it is).
    host_allocator: str | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len

    def job(self) -> JobConfig:
        """The hyperloom job for this shape; every other section keeps its default."""
        return JobConfig(
            model=self.model,
            precision=PrecisionConfig(dtype=self.dtype),
            train=TrainConfig(
                micro_batch_size=self.micro_batch,
                seed=self.seed,
                device=self.device,
                steps=self.warmup + self.steps,
                eval_batches=1,
                **({"host_allocator": self.host_allocator} if self.host_allocator else {}),
            ),
            data=DataConfig(seq_len=self.seq_len),
            ops=self.ops,
        )


# --------------------------------------------------------------------------- data


class InMemoryLoader:
    """Cycles through pre-built (inputs, labels) batches; `next_batch` like ResumableLoader."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.batches = batches
        self.i = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        return batch


def make_batches(spec: Spec, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch per step, random int64 tokens, identical in every process (fixed seed)."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    n = spec.warmup + spec.steps
    windows = torch.randint(
        0, spec.model.vocab_size, (n, spec.micro_batch, spec.seq_len + 1), generator=gen
    )  # (step, batch, seq + 1): inputs are the first seq tokens, labels the last seq
    return [(w[:, :-1].contiguous().to(device), w[:, 1:].contiguous().to(device)) for w in windows]


# --------------------------------------------------------------------------- contenders


def initial_state(spec: Spec) -> dict[str, torch.Tensor]:
    """hyperloom's initial weights (CPU, FP32): the starting point of all three contenders."""
    from hyperloom.models.registry import init_model

    return init_model(spec.model, "cpu", spec.seed).state_dict()


def plain_model(cfg: ModelConfig) -> nn.Module:
    if cfg.rope_scaling != 1.0 or cfg.tie_embeddings:
        raise SystemExit("the plain baseline implements unscaled RoPE and an untied head only")
    return PlainLlama(
        cfg.vocab_size,
        cfg.dim,
        cfg.n_layers,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.ffn_dim,
        cfg.norm_eps,
        cfg.rope_theta,
        cfg.max_seq_len,
    )


def plain_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # The plain model was written with Meta's names, so the map is the identity; kept as a
    # function so a renamed baseline only has to change this line.
    return dict(state)


class HFLogits(nn.Module):
    """`LlamaForCausalLM` seen as tokens -> logits, the way a training loop calls it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from transformers import LlamaForCausalLM

        from hyperloom.models.llama.hf import hf_config

        self.hf = LlamaForCausalLM._from_config(
            hf_config(cfg), attn_implementation="sdpa", dtype=torch.float32
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits  # (b, s, vocab)


def hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from hyperloom.models.llama.hf import to_hf_state_dict

    return {f"hf.{k}": v for k, v in to_hf_state_dict(state).items()}


def baseline_model(name: str, spec: Spec, state: dict[str, torch.Tensor]) -> nn.Module:
    """The plain or HF model holding hyperloom's initial weights (strict load)."""
    if name == "plain":
        model, mapped = plain_model(spec.model), plain_state(state)
    else:
        model, mapped = HFLogits(spec.model), hf_state(state)
    model.load_state_dict(mapped, strict=True)
    return model


def adamw(model: nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    """AdamW as a framework-free loop would set it up: weight decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # no fused kernel for this device
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def reference_step(model, optimizer, loader, acc: Accelerator, dtype, t: TrainConfig, step: int):
    """One optimizer step of the baselines: the arithmetic of `Trainer.train_step`, in plain
    torch (the LR comes from the same schedule so the three trajectories stay comparable)."""
    model.train()
    inputs, labels = loader.next_batch()
    inputs, labels = inputs.to(acc.device), labels.to(acc.device)
    if dtype == torch.float32:
        logits = model(inputs)
    else:
        with torch.autocast(device_type=acc.kind, dtype=dtype):
            logits = model(inputs)  # (b, s, vocab)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())  # FP32 loss
    loss.backward()
    clip = t.grad_clip if t.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, t)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm


def build_runner(
    name: str, spec: Spec, acc: Accelerator
) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """(model, step function returning the loss tensor) for one contender, ready to train."""
    batches = make_batches(spec, acc.device)
    job = spec.job()
    if name == "hyperloom":
        from hyperloom.data import DataBundle, TokenDataset
        from hyperloom.train.trainer import Trainer

        # A token stream just long enough for the Trainer's own loader and val batches; the
        # loader is then replaced, so the timed steps never touch the data pipeline.
        tokens = torch.cat([b[0].flatten().cpu() for b in batches]).numpy()
        stream = TokenDataset(np.append(tokens, 0))  # >= one batch of seq_len + 1 windows
        trainer = Trainer(job, DataBundle(tokenizer=None, train=stream, val=stream, corpus_info={}))
        trainer.loader = InMemoryLoader(batches)
        return trainer.model, lambda: trainer.train_step()[0]
    model = baseline_model(name, spec, initial_state(spec)).to(acc.device)
    optimizer = adamw(model, job.train)
    loader = InMemoryLoader(batches)
    dtype, counter = DTYPES[spec.dtype], itertools.count()
    return model, lambda: reference_step(
        model, optimizer, loader, acc, dtype, job.train, next(counter)
    )[0]


# --------------------------------------------------------------------------- parity


def check_parity(spec: Spec, names: list[str]) -> dict[str, Any]:
    """FP32 loss of every contender on the first batch from the same initial weights."""
    from hyperloom.models.registry import init_model
    from hyperloom.train.trainer import causal_lm_loss

    torch.set_num_threads(spec.threads)
    inputs, labels = make_batches(dataclasses.replace(spec, warmup=1, steps=0), "cpu")[0]
    state = initial_state(spec)
    losses = {}
    with torch.no_grad():
        for name in names:
            if name == "hyperloom":
                model = init_model(spec.model, "cpu", spec.seed)
            else:
                model = baseline_model(name, spec, state)
            losses[name] = causal_lm_loss(model.eval()(inputs), labels).item()
            del model
    spread = max(losses.values()) - min(losses.values())
    return {"fp32_initial_loss": losses, "max_abs_delta": spread, "tolerance": PARITY_TOL}
