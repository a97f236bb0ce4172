"""TRL ``SFTTrainer`` on planned batches: ``apply_smart_batching(trainer, "packed", capacity=...)``.

TRL tokenises the prompt/completion dataset and builds ``labels`` (-100 on the prompt); smart batching
then replaces the train DataLoader (plan + ``PackingCollator``), switches the model to packed attention
and computes TRL's plain NLL loss at the target positions only, logging the token accuracy and entropy
metrics TRL logs (another TRL ``loss_type`` keeps TRL's own ``compute_loss``). Everything is
built in-process: a word-level tokenizer over a 64-word vocabulary and a tiny Llama from its config,
so it runs offline in seconds on a CPU.

Run::

    python examples/trl_sft.py                      # packed
    python examples/trl_sft.py --strategy token_budget --json
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np
import torch

from smart_batching.hf import apply_smart_batching

WORDS = [f"w{i}" for i in range(56)]
STRATEGY_OPTIONS = {
    "random": {"batch_size": 8},
    "group_by_length": {"batch_size": 8},
    "token_budget": {"max_tokens": 384},
    "packed": {"capacity": 384},
}


def word_tokenizer():
    """A fast word-level tokenizer with ChatML-free special tokens (pad, eos, unk)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>", "<sep>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def copy_task(num_examples: int, seed: int = 0):
    """Prompt: random words then <sep>; completion: the same words reversed. Lengths vary 2..24 words."""
    import datasets

    rng = np.random.default_rng(seed)
    prompts, completions = [], []
    for n in rng.integers(2, 25, size=num_examples):
        words = rng.choice(WORDS, size=n).tolist()
        prompts.append(" ".join(words) + " <sep>")
        completions.append(" " + " ".join(reversed(words)))
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions})


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="packed", choices=sorted(STRATEGY_OPTIONS))
    parser.add_argument("--examples", type=int, default=160)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON summary line at the end")
    args = parser.parse_args(argv)

    from trl import SFTConfig, SFTTrainer

    tokenizer = word_tokenizer()
    model = tiny_llama(len(tokenizer))
    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(
            output_dir=args.output_dir or tmp,
            max_steps=args.steps,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            max_length=None,
            dataset_num_proc=None,
        )
        trainer = SFTTrainer(
            model=model, args=config, train_dataset=copy_task(args.examples), processing_class=tokenizer
        )
        apply_smart_batching(trainer, args.strategy, **STRATEGY_OPTIONS[args.strategy])
        result = trainer.train()

    logs = [h for h in trainer.state.log_history if "loss" in h]
    summary = {
        "strategy": args.strategy,
        "trainer": type(trainer).__name__,
        "attn_implementation": trainer.model.config._attn_implementation,
        "batches_per_epoch": len(trainer.smart_batching.sampler),
        "first_loss": logs[0]["loss"],
        "final_loss": logs[-1]["loss"],
        "train_loss": result.training_loss,
        "mean_token_accuracy": logs[-1].get("mean_token_accuracy"),
    }
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
