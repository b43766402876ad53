"""How tensor parallelism splits a Llama model: module path -> style (see
`hyperloom.parallel.parallelize` for what each style means)."""

TP_PLAN: dict[str, str] = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "sp_norm",
    "layers.*.attention": "tp_input",
    "layers.*.attention.wq": "colwise",  # heads split across ranks
    "layers.*.attention.wk": "colwise",  # kv heads split across ranks
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "sp_norm",
    "layers.*.feed_forward": "tp_input",
    "layers.*.feed_forward.w1": "colwise",  # SwiGLU hidden width split across ranks
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "norm": "sp_norm",
    "output": "vocab_head",  # logits stay vocab-sharded into the vocab-parallel loss
}
