"""hyperloom.data: corpora, tokenizer, packed token streams and a resumable loader.

    bundle = build_data(cfg.data, vocab_size=model_cfg.vocab_size)
    loader = ResumableLoader(bundle.train, batch_size, cfg.data.seq_len, seed)
    inputs, labels = loader.next_batch()          # (batch, seq_len) int64 each
    evals = val_batches(bundle.val, batch_size, cfg.data.seq_len, n_batches=20)

`data.source = "sft"` makes `build_data` return packed conversations (`SFTDataset`, answer-only
labels), read with `SFTLoader` and `sft_val_batches` the same way.

Sources (`readers`): the stdlib, text, JSONL, Parquet, Arrow (HF `datasets`) and Megatron
`.bin/.idx` files, or a weighted blend of them (`blend`); a build streams the corpus through
worker processes into memory-mapped token files (`stream`, `pool`), so it may exceed memory.

The config is duck-typed: any object with the `DataConfig` attributes works.
"""

from hyperloom.data.build import DataBundle, build_data, cache_root
from hyperloom.data.corpus import Document, select_subset, split_documents
from hyperloom.data.dataset import TokenDataset
from hyperloom.data.errors import DataError
from hyperloom.data.loader import ResumableLoader, val_batches
from hyperloom.data.readers import load_documents
from hyperloom.data.sft_packing import SFTDataset, SFTLoader, sft_val_batches
from hyperloom.data.tokenizer import Tokenizer, train_bpe

__all__ = [
    "DataBundle",
    "DataError",
    "Document",
    "ResumableLoader",
    "SFTDataset",
    "SFTLoader",
    "TokenDataset",
    "Tokenizer",
    "build_data",
    "cache_root",
    "load_documents",
    "select_subset",
    "sft_val_batches",
    "split_documents",
    "train_bpe",
    "val_batches",
]
