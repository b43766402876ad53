"""The vision-language family from the command line: a short training run with its held-out
answers and plot, `generate --image`, and the one-line errors bad input gets."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_VLM
from PIL import Image

from hyperloom.data.multimodal import scenes

VLM = {
    **TINY_VLM,
    "data__scene_samples": 128,
    "train__steps": 3,
    "train__warmup_steps": 1,
    "train__eval_batches": 1,
    "logging__eval_answers": 6,
    "logging__plot": "true",
}


@pytest.fixture(scope="module")
def vlm_run(tiny_job_args, cli, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vlm") / "run"
    result = cli("train", *tiny_job_args(run_dir, **VLM))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


@pytest.fixture(scope="module")
def scene_png(tmp_path_factory):
    img, _ = scenes.render_scene(3, 32, n_shapes=2)
    path = tmp_path_factory.mktemp("img") / "scene.png"
    Image.fromarray(img).save(path)
    return path


def test_training_ends_with_held_out_answers_a_caption_and_a_plot(vlm_run):
    run_dir, result = vlm_run
    summary = json.loads((run_dir / "summary.json").read_text())
    report = summary["vlm_eval"]
    assert report["n"] == 6 and 0.0 <= report["accuracy"] <= 1.0
    assert set(report["by_task"]) <= set(scenes.TASKS)
    assert "generated" in report["caption"] and report["caption"]["reference"]
    assert (run_dir / "vlm_eval.png").stat().st_size > 0
    assert "held-out answers" in result.stdout


def test_generate_answers_about_an_image(vlm_run, scene_png, cli):
    run_dir, _ = vlm_run
    prompt = "How many shapes are there?"
    result = cli("generate", "--checkpoint", str(run_dir), "--image", str(scene_png),
                 "--prompt", prompt, "--max-new-tokens", "4", "--temperature", "0")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--image", "missing.png", "--prompt", "What?"], "--image missing.png: no such file"),
        (["--prompt", "<image><image> Which?"], "2 <image> marker(s) but 1 image(s)"),
    ],
    ids=["missing-image", "marker-count"],
)
def test_generate_bad_input_is_one_line(vlm_run, scene_png, cli, tmp_path, args, message):
    run_dir, _ = vlm_run
    if "--image" not in args:
        args = ["--image", str(scene_png), *args]
    result = cli("generate", "--checkpoint", str(run_dir), *args, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr


def test_a_vlm_without_image_data_is_a_clear_error(tiny_job_args, cli, tmp_path):
    args = tiny_job_args(tmp_path / "run", **{**VLM, "data__source": "stdlib"})
    result = cli("train", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "data.source = 'scenes'" in result.stderr


def test_freezing_a_part_the_model_lacks_is_a_clear_error(tiny_job_args, cli, tmp_path):
    args = tiny_job_args(tmp_path / "run", **{**VLM, "train__freeze": '["vison"]'})
    result = cli("train", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "train.freeze pattern 'vison' matches no parameter" in result.stderr


def test_training_starts_from_an_imported_hugging_face_llava(vlm_run, tiny_job_args, cli, tmp_path):
    """Export the trained run as HF LLaVA, import it back, and start a new run from it with
    checkpoint.init_from: every tensor comes from the import, and the first validation loss
    is the exported run's last one."""
    run_dir, _ = vlm_run
    assert cli("convert", "export", str(run_dir), str(tmp_path / "hf")).returncode == 0
    assert (
        cli("convert", "import", str(tmp_path / "hf"), str(tmp_path / "imported")).returncode == 0
    )
    args = tiny_job_args(tmp_path / "tuned", **{**VLM, "logging__eval_answers": 0})
    result = cli("train", *args, "--checkpoint.init_from", str(tmp_path / "imported"))
    assert result.returncode == 0, result.stderr[-3000:]
    tuned = json.loads((tmp_path / "tuned" / "summary.json").read_text())
    first = json.loads((run_dir / "summary.json").read_text())
    assert tuned["initialised_from"]["kept_fresh"] == 0
    assert tuned["initial_val_loss"] == pytest.approx(first["final_val_loss"], rel=1e-6)
