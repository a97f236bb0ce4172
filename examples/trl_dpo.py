"""TRL ``DPOTrainer`` on planned pairs: ``apply_smart_batching(trainer, "packed")``.

TRL tokenises the preference pairs (prompt, chosen, rejected); smart batching then plans the pairs by
their token cost, packs each batch into one padding-free row with each pair's prompt shared by its two
completions, and hands TRL per-token log-probabilities equal to its padded computation, so TRL's loss
and reward metrics are unchanged. Everything is built in-process: a word-level tokenizer over a
64-word vocabulary, a tiny Llama, and a reversal task (chosen: the prompt's words reversed; rejected:
other words), so it runs offline in seconds on a CPU.

Run::

    python examples/trl_dpo.py                        # packed, prompt shared
    python examples/trl_dpo.py --strategy token_budget --json
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from smart_batching.hf import apply_smart_batching

STRATEGY_OPTIONS = {
    "random": {},
    "group_by_length": {},
    "token_budget": {"max_tokens": 512},
    "packed": {"capacity": 512},
}


def _sft_example():
    spec = importlib.util.spec_from_file_location("trl_sft_example", Path(__file__).with_name("trl_sft.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SFT = _sft_example()
WORDS = SFT.WORDS
word_tokenizer = SFT.word_tokenizer
tiny_llama = SFT.tiny_llama


def preference_task(num_pairs: int, seed: int = 0, prompt_words: tuple[int, int] = (2, 25)):
    """Pairs of a reversal task: prompt, random words then ``<sep>``; chosen, the same words reversed;
    rejected, as many other random words, give or take a few. Prompt lengths vary over ``prompt_words``."""
    import datasets

    rng = np.random.default_rng(seed)
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for n in rng.integers(*prompt_words, size=num_pairs):
        words = rng.choice(WORDS, size=n).tolist()
        rows["prompt"].append(" ".join(words) + " <sep>")
        rows["chosen"].append(" " + " ".join(reversed(words)))
        other = rng.choice(WORDS, size=max(1, n + int(rng.integers(-3, 4)))).tolist()
        rows["rejected"].append(" " + " ".join(other))
    return datasets.Dataset.from_dict(rows)


def dpo_trainer(data, *, tokenizer=None, output_dir: str | None = None, **config):
    """A ``DPOTrainer`` on a tiny Llama and a reference copy of it (fp32, no checkpointing, CPU)."""
    from trl import DPOConfig, DPOTrainer

    tokenizer = tokenizer or word_tokenizer()
    model = tiny_llama(len(tokenizer))
    base = dict(
        output_dir=output_dir or tempfile.mkdtemp(), report_to=[], use_cpu=True, disable_tqdm=True,
        per_device_train_batch_size=4, gradient_checkpointing=False, bf16=False, max_length=None,
        max_steps=1, save_strategy="no", seed=0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPOTrainer(
            model=model, ref_model=copy.deepcopy(model), args=DPOConfig(**{**base, **config}),
            train_dataset=data, processing_class=tokenizer,
        )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="packed", choices=sorted(STRATEGY_OPTIONS))
    parser.add_argument("--no-prompt-sharing", action="store_true", help="packed: each pair as two sequences")
    parser.add_argument("--pairs", type=int, default=96)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print one JSON summary line at the end")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    trainer = dpo_trainer(
        preference_task(args.pairs), max_steps=args.steps, learning_rate=1e-3, logging_steps=1,
        lr_scheduler_type="constant", beta=0.1,
    )  # fmt: skip
    options = dict(STRATEGY_OPTIONS[args.strategy])
    if args.strategy == "packed":
        options["prompt_sharing"] = not args.no_prompt_sharing
    apply_smart_batching(trainer, args.strategy, **options)
    result = trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    summary = {
        "strategy": args.strategy,
        "prompt_sharing": trainer.smart_batching.prompt_sharing,
        "trainer": type(trainer).__name__,
        "attn_implementation": trainer.model.config._attn_implementation,
        "batches_per_epoch": len(trainer.smart_batching.sampler),
        "first_loss": logs[0]["loss"],
        "final_loss": logs[-1]["loss"],
        "train_loss": result.training_loss,
        "reward_accuracy": logs[-1].get("rewards/accuracies"),
    }
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
