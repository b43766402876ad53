"""`hyperloom convert`: export to the Hugging Face format and import back, for both families."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyperloom import checkpoint as ckpt
from hyperloom.checkpoint.hf import ConvertError, export_hf, import_hf
from hyperloom.config import JobConfig, dumps_toml, preset_config, read_toml
from hyperloom.models.registry import init_model

LLAMA = dict(
    vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64
)
DEEPSEEK = dict(
    vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=4, ffn_dim=96, n_routed_experts=8,
    moe_top_k=3, moe_ffn_dim=32, moe_n_groups=4, moe_topk_groups=2, moe_route_scale=2.5,
    q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_seq_len=64, mtp_depth=0,
)  # fmt: skip


# DeepSeek-V2-Lite's routing (deepseek-v2-lite): softmax, no groups, no renormalisation.
V2_ROUTING = dict(moe_score="softmax", moe_n_groups=1, moe_topk_groups=1, moe_norm_topk=False)


def _checkpoint(run_dir, model_cfg):
    return _checkpoint_of(run_dir, init_model(model_cfg, "cpu", seed=5), model_cfg)


def _checkpoint_of(run_dir, model, model_cfg):
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    job = JobConfig()
    job = dataclasses.replace(job, model=model_cfg, data=dataclasses.replace(job.data, seq_len=32))
    ckpt.save_checkpoint(run_dir, 1, state, {"step": 1}, {"config.toml": dumps_toml(job)}, {}, 1)
    return model, state


@pytest.mark.parametrize(
    "base,values",
    [
        ("tiny", LLAMA),
        ("tiny", {**LLAMA, "tie_embeddings": True}),
        ("tiny", {**LLAMA, "rope_scaling": 8.0, "rope_original_max_seq": 16}),
        ("tiny", {**LLAMA, "qk_norm": True}),
        ("moe-tiny", DEEPSEEK),
        ("moe-tiny", {**DEEPSEEK, "mtp_depth": 2}),
        ("moe-tiny", {**DEEPSEEK, **V2_ROUTING}),
    ],
    ids=[
        "llama", "llama-tied", "llama-rope-scaled", "llama-qk-norm", "deepseek",
        "deepseek-mtp", "deepseek-softmax",
    ],
)  # fmt: skip
def test_export_then_import_is_exact(tmp_path, base, values):
    cfg = dataclasses.replace(preset_config(base), **values)
    _, state = _checkpoint(tmp_path / "run", cfg)
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == cfg.vocab_size
    back = import_hf(out, tmp_path / "back")
    again = load_file(str(back / "model.safetensors"))
    assert sorted(again) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(again[name], tensor), name
    imported = ckpt.verify_checkpoint(back)
    assert imported is not None


@pytest.mark.parametrize(
    "tied,qk_norm", [(False, False), (True, False), (False, True)], ids=["", "tied", "qk-norm"]
)
def test_exported_llama_loads_in_transformers_with_the_same_logits(tmp_path, tied, qk_norm):
    from transformers import AutoModelForCausalLM

    cfg = dataclasses.replace(preset_config("tiny"), **LLAMA, tie_embeddings=tied, qk_norm=qk_norm)
    model, _ = _checkpoint(tmp_path / "run", cfg)
    if qk_norm:  # norm weights away from one, so a dropped or misplaced norm shows
        with torch.no_grad():
            for i, layer in enumerate(model.layers.values()):
                layer.attention.q_norm.weight.copy_(torch.linspace(0.5, 2.0 + i, 16))
                layer.attention.k_norm.weight.copy_(torch.linspace(1.5 + i, 0.25, 16))
        _checkpoint_of(tmp_path / "run", model, cfg)
    hf = AutoModelForCausalLM.from_pretrained(str(export_hf(tmp_path / "run", tmp_path / "hf")))
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM")
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_import_names_what_is_wrong(tmp_path, cli):
    with pytest.raises(ConvertError, match="no config.json"):
        import_hf(tmp_path, tmp_path / "out")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConvertError, match="model_type 'gpt2' is not supported"):
        import_hf(tmp_path, tmp_path / "out")
    result = cli("convert", "import", str(tmp_path), str(tmp_path / "out"))
    assert result.returncode == 2
    assert "not supported" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("head_dim", 32, "head_dim 32 is not hidden_size / num_attention_heads"),
        ("attention_bias", True, "no bias"),
        ("use_sliding_window", True, "whole context"),
    ],
)
def test_import_refuses_a_qwen3_this_model_cannot_be(tmp_path, field, value, message):
    cfg = dataclasses.replace(preset_config("tiny"), **LLAMA, qk_norm=True)
    _checkpoint(tmp_path / "run", cfg)
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "qwen3" and raw["head_dim"] == 16
    (out / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(ConvertError, match=message):
        import_hf(out, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_import_refuses_a_run_directory_that_is_not_empty(tmp_path, cli):
    """`convert import HF_DIR RUN` into an existing run pruned that run's checkpoints (the
    import's save keeps one); a directory that holds anything is refused and left as it was."""
    cfg = dataclasses.replace(preset_config("tiny"), **LLAMA)
    _checkpoint(tmp_path / "run", cfg)
    hf = export_hf(tmp_path / "run", tmp_path / "hf")
    run = tmp_path / "existing"
    for step in (2, 4):  # a run with two checkpoints and its metrics
        state = {k: v.clone() for k, v in _checkpoint(tmp_path / "scratch", cfg)[1].items()}
        ckpt.save_checkpoint(run, step, state, {"step": step}, {}, {}, keep=5)
    (run / "metrics.jsonl").write_text('{"event": "train", "step": 4}\n')

    def tree() -> dict[str, bytes]:
        return {str(f.relative_to(run)): f.read_bytes() for f in run.rglob("*") if f.is_file()}

    before = tree()
    with pytest.raises(ConvertError, match="is not empty"):
        import_hf(hf, run)
    result = cli("convert", "import", str(hf), str(run))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"hyperloom convert: error: {run} is not empty (it may hold a run and its checkpoints, "
        "which an import would replace); import into a new or empty directory"
    )
    assert tree() == before  # byte for byte
    (tmp_path / "empty").mkdir()
    assert import_hf(hf, tmp_path / "empty") == ckpt.checkpoint_dir(tmp_path / "empty", 0)


def test_a_full_volume_is_a_convert_error_and_leaves_no_half_run(tmp_path):
    """Writes past the file size limit (`ulimit -f`) fail as on a full disk: a ConvertError
    (one line, exit status 2), and an import leaves no half-made run directory."""
    import resource

    cfg = dataclasses.replace(preset_config("tiny"), **LLAMA)
    _checkpoint(tmp_path / "run", cfg)
    hf = export_hf(tmp_path / "run", tmp_path / "hf")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))  # below the weights' size
    try:
        with pytest.raises(ConvertError, match=f"cannot write {tmp_path / 'out'}: .*too large"):
            export_hf(tmp_path / "run", tmp_path / "out")
        with pytest.raises(ConvertError, match="cannot write the checkpoint into .*too large"):
            import_hf(hf, tmp_path / "new")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not (tmp_path / "new").exists()


def _random_router_bias(model, scale: float = 0.05):
    """A correction bias large enough to change which experts tokens pick."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for moe in model.moe_layers().values():
            moe.router.expert_bias.copy_(torch.randn(moe.router.expert_bias.shape, generator=gen))
            moe.router.expert_bias.mul_(scale)


@pytest.mark.parametrize(
    "values,hf_class",
    [
        ({"mtp_depth": 1}, "DeepseekV3ForCausalLM"),
        ({"norm_eps": 1e-5}, "DeepseekV3ForCausalLM"),
        ({**V2_ROUTING, "q_lora_rank": 0}, "DeepseekV2ForCausalLM"),
        ({**V2_ROUTING, "moe_n_groups": 4, "moe_topk_groups": 2}, "DeepseekV2ForCausalLM"),
    ],
    ids=["mtp", "norm-eps-1e-5", "softmax-v2-lite", "softmax-groups"],
)
def test_exported_deepseek_loads_in_transformers_with_the_same_logits(tmp_path, values, hf_class):
    """MTP exports (the copies of the shared embedding and head are copies, not views, which
    safetensors refused); MLA's latent norms match transformers' eps (1e-6) whatever norm_eps
    is; softmax routing exports as DeepseekV2 and imports back as softmax."""
    from transformers import AutoModelForCausalLM

    cfg = dataclasses.replace(preset_config("moe-tiny"), **{**DEEPSEEK, **values})
    model = init_model(cfg, "cpu", seed=5)
    if cfg.moe_score == "sigmoid":
        _random_router_bias(model)
    _checkpoint_of(tmp_path / "run", model, cfg)
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    names = set(load_file(str(out / "model.safetensors")))
    if cfg.mtp_depth:  # the released V3 layout of the MTP layer
        mtp = f"model.layers.{cfg.n_layers}."
        for leaf in ("embed_tokens", "shared_head.head", "shared_head.norm", "eh_proj", "enorm"):
            assert f"{mtp}{leaf}.weight" in names
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == hf_class
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model.eval()(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5
    back = ckpt.resolve_checkpoint(import_hf(out, tmp_path / "back"))
    raw = read_toml(back / "config.toml")["model"]
    assert (raw["moe_score"], raw["mtp_depth"]) == (cfg.moe_score, cfg.mtp_depth)


def test_mla_latent_norms_use_eps_1e_6():
    cfg = dataclasses.replace(preset_config("moe-tiny"), **{**DEEPSEEK, "norm_eps": 1e-5})
    attention = init_model(cfg, "cpu", seed=5).layers["0"].attention
    assert (attention.q_norm.eps, attention.kv_norm.eps) == (1e-6, 1e-6)


@pytest.mark.parametrize(
    "values,message",
    [
        ({**V2_ROUTING, "moe_norm_topk": True}, "moe_norm_topk = true"),
        ({**V2_ROUTING, "mtp_depth": 1}, "mtp_depth = 1: DeepseekV2 has no MTP"),
        (V2_ROUTING, "expert_bias is not zero"),
    ],
    ids=["norm-topk", "mtp", "bias"],
)
def test_softmax_export_refuses_what_deepseek_v2_cannot_hold(tmp_path, values, message):
    cfg = dataclasses.replace(preset_config("moe-tiny"), **{**DEEPSEEK, **values})
    model = init_model(cfg, "cpu", seed=5)
    if message.startswith("expert_bias"):
        _random_router_bias(model)
    _checkpoint_of(tmp_path / "run", model, cfg)
    with pytest.raises(ConvertError, match=message):
        export_hf(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_import_refuses_an_mtp_copy_that_is_not_the_shared_embedding(tmp_path):
    cfg = dataclasses.replace(preset_config("moe-tiny"), **{**DEEPSEEK, "mtp_depth": 1})
    _checkpoint(tmp_path / "run", cfg)
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    weights = load_file(str(out / "model.safetensors"))
    weights[f"model.layers.{cfg.n_layers}.embed_tokens.weight"] += 1.0
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(ConvertError, match="embed_tokens.weight' differs from the model's shared"):
        import_hf(out, tmp_path / "back")
