"""Text generation from a trained checkpoint: KV-cached decoding with temperature, top-k, top-p.

With the cache, the prompt is run once (prefill) and every new token costs one position;
without it (`use_cache=False`) each step re-runs the whole sequence, which is slower but is
the reference the cached path is tested against (greedy decoding gives the same tokens).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hyperloom import checkpoint as ckpt
from hyperloom.accelerator import DTYPES, Accelerator, get_accelerator
from hyperloom.config import ConfigError, JobConfig, config_from_dict, read_toml
from hyperloom.data import Tokenizer
from hyperloom.engine.ops import OpImpls, use_ops
from hyperloom.inference.sampling import (
    decode_length,
    require_sampling,
    sample_next,
)
from hyperloom.models.llama import KVCache
from hyperloom.models.registry import build_model
from hyperloom.models.vlm.inputs import ImageTokens

log = logging.getLogger("hyperloom.generate")


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 1.0,
    eos_id: int | None = None,
    use_cache: bool = True,
    seed: int = 0,
    acc: Accelerator | None = None,
    dtype: torch.dtype = torch.float32,
    images: torch.Tensor | None = None,
) -> list[int]:
    """Continue `prompt`; stops at `max_new_tokens`, at `eos_id`, or at model.max_seq_len.
    `images` (n, 3, H, W): a vision-language model's images for the prompt's placeholders,
    encoded once with the prompt (prefill)."""
    require_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    acc = acc or Accelerator("cpu")
    total = decode_length(model, prompt, max_new_tokens)
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    # A family with its own cache layout (DeepSeek's compressed MLA cache) allocates it.
    allocate = getattr(model, "allocate_cache", None)
    if not use_cache:
        cache = None
    elif allocate is not None:
        cache = allocate(1, total, acc.device, dtype)
    else:
        cache = KVCache.allocate(model.cfg, 1, total, acc.device, dtype)
    pos = 0
    while len(tokens) < total:
        # With a cache, feed only the tokens the cache has not seen yet.
        chunk = tokens[pos:] if use_cache else tokens
        x = torch.tensor([chunk], device=acc.device)
        if images is not None and (pos == 0 or not use_cache):  # the prompt's placeholders
            x = ImageTokens(x, images[None].to(acc.device))
        with acc.autocast(dtype):
            logits = model(x, cache=cache, start_pos=pos if use_cache else 0)
        if use_cache:
            pos = len(tokens)
        nxt = sample_next(logits[0, -1], temperature, top_k, top_p, gen)
        tokens.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
    return tokens[len(prompt) :]


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    cfg: JobConfig
    checkpoint: Path
    acc: Accelerator


def load_for_inference(path: str | os.PathLike, device: str = "auto") -> LoadedModel:
    """Model + tokenizer + config from a checkpoint directory or a run directory."""
    ckpt_dir = ckpt.resolve_checkpoint(path)
    ckpt.verify_checkpoint(ckpt_dir)
    try:
        raw = read_toml(ckpt_dir / "config.toml")
        raw.pop("parallel", None)  # the layout that trained it: decoding runs in one process
        cfg = config_from_dict(raw, world_size=1)
    except ConfigError as exc:
        raise ckpt.CheckpointError(f"{ckpt_dir / 'config.toml'}: {exc}") from None
    acc = get_accelerator(device)
    model = build_model(cfg.model).materialize(acc.device, seed=0)
    # Decoding calls the model with a new shape per step (prompt, then one token): compiling
    # the fused kernels for each would cost more than they save, so they run eagerly here.
    # The Triton kernels, if the job asked for them, take the token count as a runtime
    # argument: a few builds in all, not one per shape.
    use_ops(model, OpImpls.choose(compile=False, triton=cfg.ops.triton))
    try:
        model.load_state_dict(ckpt.load_model_state(ckpt_dir))
    except RuntimeError as exc:
        raise ckpt.CheckpointError(
            f"{ckpt_dir}/model.safetensors does not match its config.toml: {exc}"
        ) from None
    tok = Tokenizer.load(ckpt_dir / "tokenizer.json", eos_token=cfg.data.eos_token)
    return LoadedModel(model, tok, cfg, ckpt_dir, acc)


def complete(
    loaded: LoadedModel, prompt: str, max_new_tokens: int, speculative: bool = False, **kwargs
) -> tuple[str, dict[str, float]]:
    """Generate text for `prompt`; returns (continuation, stats). `speculative` drafts with the
    model's MTP modules (`hyperloom.inference.speculative`) and adds what it counted."""
    ids = loaded.tokenizer.encode(prompt)
    kwargs.update(
        eos_id=loaded.tokenizer.eos_id, acc=loaded.acc, dtype=DTYPES[loaded.cfg.precision.dtype]
    )
    start = time.perf_counter()
    extra: dict[str, float] = {}
    if speculative:
        from hyperloom.inference import speculative as spec

        out, counts = spec.generate(loaded.model, ids, max_new_tokens, **kwargs)
        extra = counts.as_dict()
    else:
        out = generate(loaded.model, ids, max_new_tokens, **kwargs)
    seconds = time.perf_counter() - start
    return loaded.tokenizer.decode(out), {
        "prompt_tokens": len(ids),
        "new_tokens": len(out),
        "seconds": seconds,
        "tokens_per_s": len(out) / seconds if seconds > 0 else 0.0,
        **extra,
    }
