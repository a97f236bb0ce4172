"""Real tiny GRPO set-ups for the tests (one process and gloo workers): a word-level tokenizer built in
process, a tiny Llama from its config saved to a folder (TRL builds the reference model from it), prompts
of the reversal task and a plain python reward function. Completions stop at the end-of-sequence token or
at one of a few word tokens (the model's ``generation_config.eos_token_id``, which TRL reads), so their
lengths vary."""

from __future__ import annotations

import importlib.util
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("trl_sft_example", ROOT / "examples" / "trl_sft.py")
EX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)

STOP_IDS = [1, 10, 11, 12, 13]  # <eos> and four words: completions of 1 to max_completion_length tokens


def prompts(num: int, *, words: int | tuple[int, int] = 6, seed: int = 0):
    """``num`` prompts of the reversal task: ``words`` random words (a fixed count, or drawn from a range)
    then ``<sep>``."""
    import datasets

    rng = np.random.default_rng(seed)
    counts = [words] * num if isinstance(words, int) else rng.integers(*words, size=num).tolist()
    return datasets.Dataset.from_dict(
        {"prompt": [" ".join(rng.choice(EX.WORDS, size=n).tolist()) + " <sep>" for n in counts]}
    )


def reward(completions, prompts=None, **kwargs):
    """Words in common with the prompt, minus a length penalty (a plain python function)."""
    out = []
    for completion, prompt in zip(completions, prompts or [""] * len(completions), strict=True):
        words = completion.split()
        out.append(len(set(words) & set(prompt.split())) - 0.1 * len(words))
    return out


def save_model(folder: str | None = None) -> str:
    """A tiny Llama saved to ``folder`` (a new temporary folder by default); returns the folder."""
    folder = folder or tempfile.mkdtemp()
    model = EX.tiny_llama(len(EX.word_tokenizer()))
    model.generation_config.eos_token_id = STOP_IDS
    model.save_pretrained(folder)
    return folder


def grpo_trainer(model_dir: str, data, *, trainer: str = "GRPOTrainer", **config):
    """TRL's ``GRPOTrainer`` (or ``trainer="RLOOTrainer"``, whose config has no ``loss_type``) on the saved
    tiny Llama (CPU, fp32), its policy nudged away from the reference (so the KL term and the ratios are not
    trivial)."""
    import trl

    base = dict(
        output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, disable_tqdm=True, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=10, max_steps=1, beta=0.1, save_strategy="no", seed=0,
        logging_steps=1, learning_rate=1e-3, bf16=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls, config_cls = getattr(trl, trainer), getattr(trl, trainer.replace("Trainer", "Config"))
        made = cls(
            model=model_dir, reward_funcs=reward, args=config_cls(**{**base, **config}), train_dataset=data,
            processing_class=EX.word_tokenizer(),
        )  # fmt: skip
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for p in made.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return made
