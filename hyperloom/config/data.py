"""The `[data]` section: corpus, tokenizer and packing (hyperloom.data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyperloom.config.base import knob, positive

if TYPE_CHECKING:
    from hyperloom.config.job import JobConfig

# Sources of plain pretraining text or tokens (hyperloom.data.readers), the ones a blend mixes.
TEXT_SOURCES = ("stdlib", "text", "jsonl", "parquet", "arrow", "megatron")
MAX_WORKERS = 1024


@dataclass(frozen=True)
class BlendSource:
    """One source of a weighted blend: a `[[data.blend]]` table."""

    source: str = knob("jsonl", "what the paths hold (as data.source)", choices=TEXT_SOURCES)
    paths: list[str] = knob(doc="files or directories (as data.paths)", factory=list)
    text_field: str = knob("text", "JSONL field / Parquet or Arrow column of the text")
    weight: float = knob(1.0, "share of training sequences drawn from it (normalised)")
    name: str = knob("", "label in logs and the run summary; empty = source:first path")


def blend_problems(entries: list[BlendSource], tokenizer: str) -> list[str]:
    """Each `[[data.blend]]` entry's own problems, named by its index."""
    p = []
    for i, e in enumerate(entries):
        key = f"data.blend[{i}]"
        if e.weight <= 0:
            p.append(f"{key}.weight must be positive, got {e.weight}")
        if e.source != "stdlib" and not e.paths:
            p.append(f"{key}.paths is empty; source '{e.source}' needs files or directories")
        if e.source == "stdlib" and e.paths:
            p.append(f"{key}.paths is not used with source 'stdlib' (it is built in)")
        if e.source == "megatron" and not tokenizer:
            p.append(f"{key} is a megatron dataset of token ids; {_MEGATRON_TOKENIZER}")
    return p


_MEGATRON_TOKENIZER = "set data.tokenizer to the tokenizer.json it was made with"


@dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and packing."""

    source: str = knob(
        "stdlib",
        "stdlib = the running Python's standard library source; or text / jsonl files; "
        "scenes = built-in synthetic image-text set; llava = LLaVA JSONL in data.paths with "
        "images under data.image_root; sft = chat conversations (JSONL/Parquet in data.paths), "
        "learnt on the assistant's answers only; parquet / arrow (HF datasets) files; megatron "
        "= tokenized .bin/.idx pairs; blend = the weighted [[data.blend]] sources",
        choices=["stdlib", "text", "jsonl", "scenes", "llava", "sft", "parquet", "arrow",
                 "megatron", "blend"],
    )  # fmt: skip
    paths: list[str] = knob(
        doc="files or directories for source text/jsonl/parquet/arrow/megatron/llava/sft",
        factory=list,
    )
    text_field: str = knob("text", "JSONL field / Parquet or Arrow column of the document text")
    blend: list[BlendSource] = knob(
        doc="data.source = 'blend': [[data.blend]] tables {source, paths, text_field, weight, "
        "name}; each training sequence comes from one, in proportion to the weights",
        factory=list,
    )
    workers: int = knob(0, "tokenizer processes while building the cache; 0 = min(cores, 8)")
    messages_field: str = knob(
        "messages", "sft: JSONL/Parquet field holding a conversation's [{role, content}] list"
    )
    chat_template: str = knob(
        "", "sft: a Jinja chat template file; empty = the tokenizer's, else a built-in default"
    )
    sft_overflow: str = knob(
        "truncate",
        "sft: a conversation longer than seq_len + 1 tokens is cut to it (counted, logged) or "
        "refused",
        choices=["truncate", "error"],
    )
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
        if d.source in ("text", "jsonl", "sft", "parquet", "arrow", "megatron") and not d.paths:
            p.append(f"data.source = '{d.source}' needs data.paths (files or directories)")
        if d.source == "stdlib" and d.paths:
            p.append(
                "data.paths is only used with data.source = 'text' or 'jsonl' (or another source "
                "of files: parquet, arrow, megatron, sft, llava), not 'stdlib'"
            )
        if d.source == "blend" and d.paths:
            p.append(
                "data.paths is not used with data.source = 'blend': each [[data.blend]] entry "
                "has its own paths"
            )
        if d.source == "megatron" and not d.tokenizer:
            p.append(f"data.source = 'megatron' reads token ids; {_MEGATRON_TOKENIZER}")
        if d.source == "blend":
            if not d.blend:
                p.append(
                    "data.source = 'blend' needs [[data.blend]] tables (source, paths, weight)"
                )
            p += blend_problems(d.blend, d.tokenizer)
        elif d.blend:
            p.append(f"data.blend is only used with data.source = 'blend' (it is '{d.source}')")
        if not 0 <= d.workers <= MAX_WORKERS:
            p.append(
                f"data.workers must lie in 0..{MAX_WORKERS} (0 = min(cores, 8)), got {d.workers}"
            )
        if d.source == "scenes" and d.paths:
            p.append("data.paths is not used with data.source = 'scenes' (it is built in)")
        if d.source == "llava" and not d.paths:
            p.append("data.source = 'llava' needs data.paths (LLaVA JSONL files or directories)")
        if d.max_images < 1:
            p.append(f"data.max_images must be >= 1, got {d.max_images}")
        if d.scene_samples < 1:
            p.append(f"data.scene_samples must be >= 1, got {d.scene_samples}")
        return p
