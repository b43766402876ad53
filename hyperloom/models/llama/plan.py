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
    # model.qk_norm (added by tp_plan): the norms run on this rank's heads only, so their
    # weights' gradients are partial sums over the group's heads.
    "layers.*.ffn_norm": "sp_norm",
    "layers.*.feed_forward": "tp_input",
    "layers.*.feed_forward.w1": "colwise",  # SwiGLU hidden width split across ranks
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "norm": "sp_norm",
    "output": "vocab_head",  # logits stay vocab-sharded into the vocab-parallel loss
}


# Where each recompute module sits in a block (`hyperloom.parallel.recompute`): a region
# checkpointed whole, or (producer, consumer): the producer's output is dropped after the
# consumer's forward and rebuilt before its backward.
RECOMPUTE_PLAN: dict[str, list] = {
    "core_attn": ["attention.core_attention"],
    "mlp_act": [("feed_forward.act", "feed_forward.w2")],
    "norm": [("attention_norm", "attention"), ("ffn_norm", "feed_forward")],
}


def recompute_plan(cfg) -> dict[str, list]:
    """RECOMPUTE_PLAN: one for every shape of the family."""
    return RECOMPUTE_PLAN


def tp_plan(cfg) -> dict[str, str]:
    """TP_PLAN, with the qk-norm weights when the model has them (`model.qk_norm`)."""
    if not cfg.qk_norm:
        return TP_PLAN
    norms = {f"layers.*.attention.{n}": "tp_partial_grad" for n in ("q_norm", "k_norm")}
    return {**TP_PLAN, **norms}


def pipeline_chunk(model, layers: range, first: bool, last: bool):
    """Cut `model` (on the meta device) down to one pipeline chunk, in place.

    The chunk keeps layers `layers` under their global names, the embedding if it is the
    first chunk, and the final norm and head if it is the last one. With tied embeddings the
    last chunk keeps the embedding too, as its head's weight; its gradient is summed with the
    first chunk's copy (`hyperloom.pipeline.runtime`).
    """
    for key in list(model.layers.keys()):
        if int(key) not in layers:
            del model.layers[key]
    if not first and not (last and model.output is None):
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model
