"""Fine-tuning a Hugging Face checkpoint in one command: `hyperloom train --model.preset
hf:DIR --checkpoint.init_from hf:DIR` takes the architecture from DIR's config.json, converts
its weights in memory and reads text with its tokenizer.json; the first validation loss is the
Hugging Face model's on the same tokens. A job whose [model] is not DIR's is refused, listing
the keys, before any data is read; a tokenizer larger than the model's vocabulary too."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import override_args
from test_convert_sweep import randomize

from hyperloom.checkpoint.hf import ConvertError  # noqa: F401 - registers the hf: preset
from hyperloom.config import config_from_dict, read_toml
from hyperloom.data import build_data, val_batches

transformers = pytest.importorskip("transformers")

EOS = "</s>"
HF_CONFIGS = {
    "llama": dict(
        model_type="llama", vocab_size=320, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rms_norm_eps=1e-5,
    ),
    # transformers' V3 config declares one MTP layer its model does not have: none is held
    "deepseek": dict(
        model_type="deepseek_v3", vocab_size=320, hidden_size=32, intermediate_size=48,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 0.7,
                         "mscale_all_dim": 0.7},
    ),
}  # fmt: skip
JOB = dict(
    data__seq_len=32, data__max_corpus_mb=0.2, data__val_fraction=0.2,
    train__micro_batch_size=2, train__steps=2, train__eval_every=0, train__eval_batches=2,
    train__device="cpu", precision__dtype="fp32", logging__progress=False, logging__plot=False,
    logging__sample_tokens=0, logging__self_check="off", logging__peak_tflops=1,
)  # fmt: skip


def _tokenizer(path, vocab: int) -> None:
    """A byte-level BPE of `vocab` tokens (eos </s>) in the Hugging Face tokenizer.json format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], initial_alphabet=alphabet)
    text = ["def main(argv):\n    return parse(argv) + 1\n", "import os\nclass A(B):\n    pass\n"]
    tok.train_from_iterator(text * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))


def _hf_dir(tmp_path, family: str, **keys):
    config = transformers.AutoConfig.for_model(**{**HF_CONFIGS[family], **keys})
    model = randomize(transformers.AutoModelForCausalLM.from_config(config))
    model.save_pretrained(str(tmp_path / "hf"))
    _tokenizer(tmp_path / "hf", 300)
    return model, tmp_path / "hf"


@pytest.mark.parametrize("family", HF_CONFIGS)
def test_one_command_fine_tunes_a_hugging_face_checkpoint(family, tmp_path, cli):
    hf, hf_dir = _hf_dir(tmp_path, family)
    run = tmp_path / "run"
    source = f"hf:{hf_dir}"
    args = override_args(**JOB, logging__run_dir=run)
    result = cli("train", "--model.preset", source, "--checkpoint.init_from", source, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    # the data the run read: the directory's tokenizer and eos token
    job = config_from_dict(read_toml(run / "config.toml"), world_size=1)
    assert (job.data.tokenizer, job.data.eos_token) == (str(hf_dir / "tokenizer.json"), EOS)
    assert job.model.family == family and job.model.mtp_depth == 0
    bundle = build_data(job.data, job.model.vocab_size)
    batches = val_batches(bundle.val, JOB["train__micro_batch_size"], 32, 2)
    with torch.no_grad():  # the Hugging Face model's loss on the run's validation batches
        losses = [
            F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item() for x, y in batches
        ]
    expected = sum(losses) / len(losses)
    assert abs(expected - torch.tensor(320.0).log().item()) > 0.5  # not a near-uniform model
    assert summary["initial_val_loss"] == pytest.approx(expected, abs=1e-5)
    assert summary["steps"] == 2 and summary["final_train_loss"] is not None


def test_a_job_that_is_not_the_directory_s_architecture_is_refused(tmp_path, cli):
    _, hf_dir = _hf_dir(tmp_path, "llama")
    args = override_args(**JOB, logging__run_dir=tmp_path / "run")
    result = cli("train", "--checkpoint.init_from", str(hf_dir), "--model.vocab_size", "320", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    err = result.stderr.strip().splitlines()[-1]
    assert err.startswith("hyperloom train: error: checkpoint.init_from = ")
    assert "model.dim: job 384, directory 32" in err and "model.n_layers: job 6, directory 2" in err
    assert f"--model.preset hf:{hf_dir}" in err
    assert "tokenized" not in result.stderr  # refused before any data was read


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, cli):
    _, hf_dir = _hf_dir(tmp_path, "llama", vocab_size=270)  # the tokenizer holds more
    source = f"hf:{hf_dir}"
    args = override_args(**JOB, logging__run_dir=tmp_path / "run")
    result = cli("train", "--model.preset", source, "--checkpoint.init_from", source, *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "but the model's vocab_size is 270" in result.stderr
