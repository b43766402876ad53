"""The `[data]` section: corpus, tokenizer and packing (hyperloom.data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob, positive

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig


@dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and packing."""

    source: str = knob(
        "stdlib",
        "stdlib = the running Python's standard library source; or text / jsonl files; "
        "scenes = built-in synthetic image-text set; llava = LLaVA JSONL in data.paths with "
        "images under data.image_root",
        choices=["stdlib", "text", "jsonl", "scenes", "llava"],
    )
    paths: list[str] = knob(doc="files or directories for source text/jsonl/llava", factory=list)
    text_field: str = knob("text", "JSONL field holding the document text")
    tokenizer: str = knob("", "path to a tokenizer.json; empty = built-in BPE trained and cached")
    eos_token: str = knob("<|endoftext|>", "token that separates documents")
    seq_len: int = knob(256, "tokens per training sequence")
    val_fraction: float = knob(0.02, "fraction of documents held out for validation")
    max_corpus_mb: float = knob(0.0, "use a deterministic subset of about this many MB (0 = all)")
    image_root: str = knob(
        "", "folder the llava JSONL's image paths are relative to; empty = the JSONL's folder"
    )
    max_images: int = knob(2, "images one sample may hold (the batch's image slots)")
    scene_samples: int = knob(20000, "samples in the built-in scenes training split")
    cache_dir: str = knob(
        "", "tokenizer/token cache; empty = $HYPERLOOM_CACHE or ~/.cache/hyperloom"
    )

    def problems(self, job: JobConfig) -> list[str]:
        """Sequence length against the model's RoPE tables; sources, paths, image slots."""
        d, max_seq_len = self, job.model.max_seq_len
        p = positive("data.seq_len", d.seq_len)
        if not p and d.seq_len > max_seq_len:
            p.append(
                f"data.seq_len ({d.seq_len}) exceeds model.max_seq_len ({max_seq_len}); "
                f"raise model.max_seq_len or shorten the sequences"
            )
        if not 0.0 < d.val_fraction < 1.0:
            p.append(f"data.val_fraction must lie strictly between 0 and 1, got {d.val_fraction}")
        if d.max_corpus_mb < 0:
            p.append(f"data.max_corpus_mb must be >= 0 (0 = whole corpus), got {d.max_corpus_mb}")
        if d.source in ("text", "jsonl") and not d.paths:
            p.append(f"data.source = '{d.source}' needs data.paths (files or directories)")
        if d.source == "stdlib" and d.paths:
            p.append("data.paths is only used with data.source = 'text' or 'jsonl'")
        if d.source == "scenes" and d.paths:
            p.append("data.paths is not used with data.source = 'scenes' (it is built in)")
        if d.source == "llava" and not d.paths:
            p.append("data.source = 'llava' needs data.paths (LLaVA JSONL files or directories)")
        if d.max_images < 1:
            p.append(f"data.max_images must be >= 1, got {d.max_images}")
        if d.scene_samples < 1:
            p.append(f"data.scene_samples must be >= 1, got {d.scene_samples}")
        return p
