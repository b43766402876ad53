"""Answers from a vision-language checkpoint: held-out accuracy, a caption, an image prompt.

After `hyperloom train` of a vlm the main process loads the final checkpoint into one
process -- whatever layout trained it -- and answers held-out questions by greedy decoding
with the KV cache, the images encoded once with the prompt. An answer counts when it equals
the reference (case and spacing aside); each task's accuracy is shown beside its chance
level, the accuracy of guessing among the answers the task allows. A caption of a held-out
scene and the accuracies go to one figure. `hyperloom generate --image` uses the same
prompt template (LLaVA-1.5's "USER: <image>\\n... ASSISTANT:").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyperloom.accelerator import DTYPES
from hyperloom.config.models.vlm import tokens_per_image
from hyperloom.data.multimodal.dataset import (
    CLIP_MEAN,
    CLIP_STD,
    IMAGE_MARKER,
    EvalItem,
    encode_prompt,
    eval_item,
    eval_prompts,
    score_answers,
)
from hyperloom.inference.generate import LoadedModel, generate


def image_prompt(loaded: LoadedModel, question: str, n_images: int) -> list[int]:
    """Token ids of one user turn asking `question` about `n_images` images, as training
    tokenizes it: the markers (prepended where the question has none) expanded to each
    image's placeholders."""
    cfg = loaded.cfg.model
    if IMAGE_MARKER not in question and n_images:
        question = IMAGE_MARKER * n_images + "\n" + question
    markers = question.count(IMAGE_MARKER)
    if markers != n_images:
        raise ValueError(
            f"the prompt has {markers} {IMAGE_MARKER} marker(s) but {n_images} image(s) were "
            f"given; give one --image per marker"
        )
    return encode_prompt(loaded.tokenizer, question, cfg.image_token_id, tokens_per_image(cfg))


def answer(
    loaded: LoadedModel,
    prompt: Sequence[int],
    images: torch.Tensor | None,
    max_new_tokens: int,
    **sampling: Any,
) -> str:
    """The answer to a prompt of token ids with its images (n, 3, H, W): greedy unless
    `sampling` (generate's temperature, top_k, top_p, seed) says otherwise."""
    sampling = {"temperature": 0.0, "top_k": 0, **sampling}
    out = generate(
        loaded.model,
        list(prompt),
        max_new_tokens,
        **sampling,
        eos_id=loaded.tokenizer.eos_id,
        acc=loaded.acc,
        dtype=DTYPES[loaded.cfg.precision.dtype],
        images=images,
    )
    if out and out[-1] == loaded.tokenizer.eos_id:
        out = out[:-1]
    return loaded.tokenizer.decode(out).strip()


def answer_items(
    loaded: LoadedModel,
    items: Sequence[EvalItem],
    max_new_tokens: int = 48,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    out = []
    for i, item in enumerate(items):
        images = item.images[: item.n_images] if item.n_images else None
        out.append(answer(loaded, item.prompt.tolist(), images, max_new_tokens))
        if progress is not None:
            progress(i + 1)
    return out


def evaluate_answers(
    loaded: LoadedModel, dataset, n: int, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Exact-match accuracy on the first `n` held-out questions, by task, with chance levels,
    a few examples, and the seconds it took."""
    start = time.perf_counter()
    items = eval_prompts(dataset, n)
    predicted = answer_items(loaded, items, progress=progress)
    report = score_answers(items, predicted)
    report["examples"] = [
        {"task": it.task, "answer": it.answer, "predicted": p}
        for it, p in list(zip(items, predicted, strict=True))[:8]
    ]
    report["seconds"] = time.perf_counter() - start
    return report


def caption_item(dataset) -> EvalItem | None:
    """The first held-out captioning question, if the set has one (its image drawn alone)."""
    for i, conv in enumerate(dataset.conversations):
        if conv.task == "caption":
            return eval_item(dataset, i)
    return None


def to_picture(image: torch.Tensor) -> np.ndarray:
    """A normalized image (3, H, W) back to (H, W, 3) in [0, 1] for plotting."""
    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    return (image.float().cpu() * std + mean).clamp(0, 1).permute(1, 2, 0).numpy()


def plot_report(
    path: Path, report: dict[str, Any], image: torch.Tensor | None, caption: str, reference: str
) -> Path:
    """One figure: a held-out image with the generated and the reference caption, and the
    accuracy of each task beside its chance level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=[1, 1.6])
    if image is not None:
        left.imshow(to_picture(image), interpolation="nearest")
        left.set_title(f"generated: {caption}\nreference: {reference}", fontsize=8, wrap=True)
    left.axis("off")
    tasks = list(report["by_task"])
    acc = [report["by_task"][t]["accuracy"] for t in tasks]
    chance = [report["by_task"][t]["chance"] for t in tasks]
    x = np.arange(len(tasks))
    right.bar(x - 0.2, acc, 0.4, label="held-out accuracy")
    right.bar(x + 0.2, chance, 0.4, label="chance", color="0.7")
    right.set_xticks(x, [f"{t}\n(n={report['by_task'][t]['n']})" for t in tasks], fontsize=8)
    right.set_ylim(0, 1)
    right.set_title(
        f"exact-match accuracy {report['accuracy']:.1%} vs chance {report['chance']:.1%} "
        f"({report['n']} held-out questions)",
        fontsize=9,
    )
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def vlm_report(
    loaded: LoadedModel,
    dataset,
    run_dir: Path,
    n: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Held-out accuracy, a generated caption and the figure `vlm_eval.png` in `run_dir`."""
    report = evaluate_answers(loaded, dataset, n, progress)
    item = caption_item(dataset)
    caption = reference = ""
    image = None
    if item is not None:
        image = item.images[0]
        caption = answer(loaded, item.prompt.tolist(), item.images[: item.n_images], 64)
        reference = item.answer
    report["caption"] = {"generated": caption, "reference": reference}
    report["plot"] = str(plot_report(run_dir / "vlm_eval.png", report, image, caption, reference))
    return report
