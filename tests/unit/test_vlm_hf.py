"""The vision-language family and transformers' `LlavaForConditionalGeneration`: logits equal
through import (a random HF model -> ours) and export (ours -> an HF directory that
`from_pretrained` reads), for CLIP and SigLIP towers, feature layers and strategies, image and
patch sizes, llama and deepseek decoders; `hyperloom convert` round trips on disk; the errors
for what LLaVA cannot express; the parameter count of llava-1.5-7b."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyperloom import checkpoint as ckpt
from hyperloom.checkpoint.hf import ConvertError, export_hf, import_hf
from hyperloom.config import (
    JobConfig,
    ModelConfig,
    config_from_dict,
    dumps_toml,
    preset_config,
    read_toml,
)
from hyperloom.config.models.vlm import tokens_per_image
from hyperloom.models.registry import build_model, init_model
from hyperloom.models.vlm import ImageTokens, param_count
from hyperloom.models.vlm import hf as vlm_hf

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = 120
DATA = {"seq_len": 64, "source": "scenes"}  # a vlm's config needs an image source
LLAMA = dict(
    vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, norm_eps=1e-5,
    rope_theta=10000.0, max_seq_len=128, tie_embeddings=False,
)  # fmt: skip
DEEPSEEK = dict(
    vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=4, ffn_dim=96, n_routed_experts=8,
    n_shared_experts=1, n_dense_layers=1, moe_top_k=3, moe_ffn_dim=32, moe_n_groups=4,
    moe_topk_groups=2, moe_route_scale=2.5, q_lora_rank=24, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_seq_len=128, mtp_depth=0,
)  # fmt: skip
# Every layout key spelled out: the base preset (vlm-tiny) has a layout of its own.
CLIP = dict(
    vision_class_token=True,
    vision_pre_norm=True,
    vision_patch_bias=False,
    vision_act="quick_gelu",
    vision_feature_select="default",
)
SIGLIP = dict(
    vision_class_token=False,
    vision_pre_norm=False,
    vision_patch_bias=True,
    vision_act="gelu_tanh",
    vision_feature_select="full",
)

# name -> (decoder keys, vision keys); vision widths 32-48, 2-3 blocks.
CASES = {
    "clip-32px-p8-layer-2": (LLAMA, dict(CLIP, image_size=32, patch_size=8)),
    "clip-28px-p7-last-full": (
        LLAMA,
        dict(
            CLIP, image_size=28, patch_size=7, vision_feature_layer=-1, vision_feature_select="full"
        ),
    ),
    "clip-24px-p4-layer1-gelu": (
        LLAMA,
        dict(CLIP, image_size=24, patch_size=4, vision_feature_layer=1, vision_act="gelu"),
    ),
    "clip-no-projector-bias-tied": (
        {**LLAMA, "tie_embeddings": True},
        dict(
            CLIP,
            image_size=32,
            patch_size=16,
            vision_dim=48,
            vision_heads=6,
            projector_bias=False,
            vision_layers=2,
        ),
    ),
    "siglip-32px-p8-layer-2": (LLAMA, dict(SIGLIP, image_size=32, patch_size=8)),
    "siglip-30px-p6-last": (
        LLAMA,
        dict(
            SIGLIP,
            image_size=30,
            patch_size=6,
            vision_feature_layer=-1,
            vision_feature_select="full",
        ),
    ),
    "deepseek-clip": (DEEPSEEK, dict(CLIP, image_size=32, patch_size=8)),
}


def vlm_config(decoder: dict, vision: dict) -> ModelConfig:
    values = {
        "vision_dim": 32, "vision_layers": 3, "vision_heads": 4, "vision_ffn_dim": 64,
        "vision_norm_eps": 1e-5, "image_token_id": IMAGE_TOKEN, **decoder, **vision,
    }  # fmt: skip
    if "n_routed_experts" in decoder:
        base = preset_config("moe-tiny")
        values.update(family="vlm", vlm_decoder="deepseek")
    else:
        base = preset_config("vlm-tiny")
    cfg = dataclasses.replace(base, **values)
    return config_from_dict(_model_section(cfg), world_size=1).model  # validated


def _model_section(cfg: ModelConfig) -> dict:
    return {"model": dataclasses.asdict(cfg), "data": DATA}


def hand_llava_config(cfg: ModelConfig):
    """The `LlavaConfig` for `cfg`, written out with transformers' classes (not the adapter)."""
    vision = dict(
        hidden_size=cfg.vision_dim,
        intermediate_size=cfg.vision_ffn_dim,
        num_hidden_layers=cfg.vision_layers,
        num_attention_heads=cfg.vision_heads,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        layer_norm_eps=cfg.vision_norm_eps,
        hidden_act={"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.vision_act, cfg.vision_act),
    )
    if cfg.vision_class_token:
        vision_config = transformers.CLIPVisionConfig(**vision)
    else:  # a pooling head LLaVA never runs: import drops it
        vision_config = transformers.SiglipVisionConfig(**vision, vision_use_head=True)
    if cfg.vlm_decoder == "deepseek":
        from hyperloom.models.deepseek.hf import hf_config

        text_config = hf_config(cfg)
    else:
        text_config = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.dim,
            intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads,
            max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps,
            tie_word_embeddings=cfg.tie_embeddings,
        )
    return transformers.LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=cfg.image_token_id,
        vision_feature_layer=cfg.vision_feature_layer,
        vision_feature_select_strategy=(
            cfg.vision_feature_select if cfg.vision_class_token else "full"
        ),
        multimodal_projector_bias=cfg.projector_bias,
        tie_word_embeddings=cfg.tie_embeddings,
    )


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter N(0, 0.1) (LayerNorm weights around one): a misplaced or dropped
    tensor, bias or norm cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            norm = "norm" in name and name.endswith(".weight")
            p.copy_(1.0 + noise if norm else noise)


def batch(cfg: ModelConfig, counts: list[int], seed: int = 0):
    """Rows with `counts[b]` images each (0 = text only): (ImageTokens, input_ids,
    pixel_values) -- the same batch in our layout and in HF's."""
    gen = torch.Generator().manual_seed(seed)
    per = tokens_per_image(cfg)
    seq = max(counts) * (per + 3) + 12
    tokens = torch.randint(0, IMAGE_TOKEN, (len(counts), seq), generator=gen)
    for row, k in enumerate(counts):
        for i in range(k):
            start = 2 + row + i * (per + 3)
            tokens[row, start : start + per] = IMAGE_TOKEN
    size = cfg.image_size
    images = torch.randn(len(counts), max(counts), 3, size, size, generator=gen)
    pixels = torch.cat([images[row, :k] for row, k in enumerate(counts)])
    return ImageTokens(tokens, images), tokens, pixels


COUNTS = [2, 0, 1]  # two images, a text-only row, one image


def assert_same_logits(ours: torch.nn.Module, hf, cfg: ModelConfig) -> None:
    inputs, input_ids, pixels = batch(cfg, COUNTS)
    with torch.no_grad():
        got = ours(inputs)
        expected = hf(input_ids=input_ids, pixel_values=pixels).logits
        # The images reach the logits: other pixels, other logits after row 0's images.
        other = ours(ImageTokens(inputs.tokens, inputs.images.flip(1)))
    assert got.shape == expected.shape == (*input_ids.shape, cfg.vocab_size)
    assert expected.abs().max() > 0.1  # not a comparison of near-zero tensors
    assert (got - expected).abs().max().item() <= 1e-5
    assert (other[0] - got[0]).abs().max() > 1e-3
    assert (other[1] - got[1]).abs().max() <= 1e-6  # the text-only row saw no image


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_logits_equal_transformers(case, caplog):
    cfg = vlm_config(*CASES[case])
    hf = transformers.LlavaForConditionalGeneration(hand_llava_config(cfg)).eval()
    randomize(hf, seed=1)
    values = vlm_hf.config_from_hf(hf.config)
    imported = config_from_dict({"model": values, "data": DATA}, world_size=1).model
    for field in dataclasses.fields(ModelConfig):  # the config maps back field for field
        if field.name in values and field.name != "rope_original_max_seq":
            got, want = getattr(imported, field.name), getattr(cfg, field.name)
            if not (field.name == "vision_feature_select" and not cfg.vision_class_token):
                assert got == want, field.name  # (SigLIP: 'full' and 'default' are the same)
    ours = build_model(imported).materialize(torch.device("cpu"), seed=0).eval()
    with caplog.at_level(logging.WARNING, logger="hyperloom.convert"):
        state = vlm_hf.from_hf_state_dict(hf.state_dict(), imported)
    if not cfg.vision_class_token:
        assert "attention-pooling head" in caplog.text
    ours.load_state_dict(state, strict=True)
    assert_same_logits(ours, hf, imported)


def save_hf(model: torch.nn.Module, cfg: ModelConfig, out) -> None:
    tensors = {
        k: v.contiguous() for k, v in vlm_hf.to_hf_state_dict(model.state_dict(), cfg).items()
    }
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    vlm_hf.hf_config(cfg).save_pretrained(str(out))


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_logits_equal_transformers(case, tmp_path):
    cfg = vlm_config(*CASES[case])
    ours = init_model(cfg, "cpu", seed=3).eval()
    randomize(ours, seed=2)
    save_hf(ours, cfg, tmp_path / "hf")
    hf, info = transformers.LlavaForConditionalGeneration.from_pretrained(
        str(tmp_path / "hf"), output_loading_info=True
    )
    assert not any(info.values()), info  # every tensor found its place, none left over
    assert_same_logits(ours, hf.eval(), cfg)
    # The published llava-hf names, which every transformers version reads.
    names = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(
        n.startswith(("vision_tower.vision_model.", "multi_modal_projector.", "language_model."))
        for n in names
    )
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert raw["model_type"] == "llava" and raw["image_token_index"] == IMAGE_TOKEN
    assert raw["image_seq_length"] == tokens_per_image(cfg)
    if not cfg.vision_class_token:
        assert raw["vision_config"]["model_type"] == "siglip_vision_model"
        assert raw["vision_config"]["vision_use_head"] is False
        assert raw["vision_feature_select_strategy"] == "full"


def _read_config(path) -> JobConfig:
    raw = read_toml(path)
    raw.pop("parallel", None)
    return config_from_dict(raw, world_size=1)


def _checkpoint(run_dir, cfg: ModelConfig, seed: int = 5) -> dict[str, torch.Tensor]:
    model = init_model(cfg, "cpu", seed=seed)
    randomize(model, seed)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    job = JobConfig()
    job = dataclasses.replace(job, model=cfg, data=dataclasses.replace(job.data, **DATA))
    ckpt.save_checkpoint(run_dir, 1, state, {"step": 1}, {"config.toml": dumps_toml(job)}, {}, 1)
    return state


@pytest.mark.parametrize("case", ["clip-28px-p7-last-full", "siglip-30px-p6-last", "deepseek-clip"])
def test_convert_export_then_import_is_exact(case, tmp_path, cli):
    cfg = vlm_config(*CASES[case])
    state = _checkpoint(tmp_path / "run", cfg)
    if case.startswith("clip"):  # the command line itself, once
        result = cli("convert", "export", str(tmp_path / "run"), str(tmp_path / "hf"))
        assert result.returncode == 0, result.stderr[-2000:]
        result = cli("convert", "import", str(tmp_path / "hf"), str(tmp_path / "back"))
        assert result.returncode == 0, result.stderr[-2000:]
        back = ckpt.resolve_checkpoint(tmp_path / "back")
    else:
        back = import_hf(export_hf(tmp_path / "run", tmp_path / "hf"), tmp_path / "back")
    ckpt.verify_checkpoint(back)
    again = load_file(str(back / "model.safetensors"))
    assert sorted(again) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(again[name], tensor), name
    model = _read_config(back / "config.toml").model
    keys = ("family", "vlm_decoder", "image_size", "patch_size", "vision_feature_layer", "dim")
    assert all(getattr(model, k) == getattr(cfg, k) for k in keys)
    assert tokens_per_image(model) == tokens_per_image(cfg)


def test_import_reads_a_save_pretrained_directory_and_drops_a_siglip_head(tmp_path, caplog):
    """transformers 5's own on-disk names (`vision_tower.embeddings.*`, no `vision_model.`)
    and a SigLIP pooling head: the head is dropped with a warning, the logits stay HF's."""
    cfg = vlm_config(*CASES["siglip-32px-p8-layer-2"])
    hf = transformers.LlavaForConditionalGeneration(hand_llava_config(cfg)).eval()
    randomize(hf, seed=4)
    hf.save_pretrained(str(tmp_path / "hf"))
    assert any(".head." in n for n in load_file(str(tmp_path / "hf" / "model.safetensors")))
    with caplog.at_level(logging.WARNING, logger="hyperloom.convert"):
        back = import_hf(tmp_path / "hf", tmp_path / "run")
    assert "dropped the SigLIP tower's attention-pooling head" in caplog.text
    job = _read_config(back / "config.toml")
    ours = build_model(job.model).materialize(torch.device("cpu"), seed=0).eval()
    ours.load_state_dict(ckpt.load_model_state(back), strict=True)
    assert_same_logits(ours, hf, job.model)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(pixel_shuffle=2), "pixel_shuffle = 2: Hugging Face LLaVA feeds the projector"),
        (dict(projector="linear"), "projector = 'linear': Hugging Face LLaVA's projector is"),
        (dict(vision_pre_norm=False), "mixes the CLIP and SigLIP layouts"),
        (dict(SIGLIP, vision_patch_bias=False), "mixes the CLIP and SigLIP layouts"),
    ],
    ids=["pixel-shuffle", "linear-projector", "clip-without-pre-norm", "siglip-without-bias"],
)
def test_export_refuses_what_llava_cannot_express(tmp_path, overrides, message):
    decoder, vision = CASES["clip-32px-p8-layer-2"]
    cfg = vlm_config(decoder, {**vision, **overrides})
    _checkpoint(tmp_path / "run", cfg)
    with pytest.raises(ConvertError, match=message):
        export_hf(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before anything is written
    with pytest.raises(ValueError, match=message):  # the CLI's export says ConvertError
        vlm_hf.hf_config(cfg)


def test_export_refusal_on_the_command_line(tmp_path, cli):
    decoder, vision = CASES["clip-32px-p8-layer-2"]
    _checkpoint(tmp_path / "run", vlm_config(decoder, {**vision, "pixel_shuffle": 2}))
    result = cli("convert", "export", str(tmp_path / "run"), str(tmp_path / "hf"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "cannot export as transformers' LlavaForConditionalGeneration" in result.stderr
    assert "model.pixel_shuffle = 2" in result.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "case,edit,message",
    [
        ("clip-32px-p8-layer-2", {"vision_feature_layer": [-2, -1]}, "not several layers"),
        ("clip-32px-p8-layer-2", {"vision_feature_layer": 0}, "embeddings before the first"),
        ("clip-32px-p8-layer-2", {"vision_feature_layer": -4}, "embeddings before the first"),
        ("clip-32px-p8-layer-2", {"vision_feature_layer": 7}, "out of range for a 3-block"),
        ("clip-32px-p8-layer-2", {"projector_hidden_act": "relu"}, "projector_hidden_act 'relu'"),
        ("siglip-32px-p8-layer-2", {"vision_feature_select_strategy": "default"}, "first patch"),
        ("clip-32px-p8-layer-2", {"vision_config": {"hidden_act": "relu"}}, "hidden_act 'relu'"),
        ("clip-32px-p8-layer-2", {"text_config": {"model_type": "mistral"}}, "'mistral' is not"),
    ],
    ids=[
        "layer-list", "layer-0", "layer-embeddings", "layer-out-of-range", "projector-act",
        "siglip-default", "vision-act", "text-model-type",
    ],
)  # fmt: skip
def test_import_refuses_a_llava_this_model_cannot_be(tmp_path, case, edit, message):
    cfg = vlm_config(*CASES[case])
    _checkpoint(tmp_path / "run", cfg)
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    raw = json.loads((out / "config.json").read_text())
    for key, value in edit.items():
        if isinstance(value, dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConvertError, match=message):
        import_hf(out, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_llava_1_5_7b_parameter_count_equals_transformers(cli):
    cfg = preset_config("llava-1.5-7b")
    assert param_count(cfg) == 7_063_427_072
    assert sum(p.numel() for p in build_model(cfg).parameters()) == 7_063_427_072
    # llava-hf/llava-1.5-7b-hf's config.json, written out.
    vision = transformers.CLIPVisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        image_size=336, patch_size=14, projection_dim=768, vocab_size=32000,
    )  # fmt: skip
    text = transformers.LlamaConfig(vocab_size=32064, max_position_embeddings=4096)
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=32000, pad_token_id=32001
    )
    for hf_config in (config, vlm_hf.hf_config(cfg)):
        with torch.device("meta"):
            hf = transformers.LlavaForConditionalGeneration(hf_config)
        assert sum(p.numel() for p in hf.parameters()) == 7_063_427_072
    assert vlm_hf.config_from_hf(config)["image_token_id"] == cfg.image_token_id
    result = cli("model", "info", "llava-1.5-7b")
    assert result.returncode == 0 and "7,063,427,072" in result.stdout
