"""GRPO on several ranks: how uneven TRL's deal of completions leaves an optimizer step, and how even
``balance_ranks`` makes it (planning only: token counts, no model).

TRL's ``GRPOTrainer`` deals each rank a contiguous slice of the global generation batch (whole groups of
``num_generations`` completions of one prompt), shuffles it and splits it into ``steps_per_generation``
micro-batches; with ``gradient_accumulation_steps`` equal to that (TRL's default), a rank's step is its
whole slice, and every rank waits at the step's all-reduce for the one holding the most tokens. With
``balance_ranks`` the step's completions are dealt again to the ranks by
:func:`smart_batching.hf.grpo.ranks.deal_to_ranks` (the function the trainer runs), each rank keeping its
count.

Prompts are GSM8K train questions (``"Question: {question}\\nAnswer:"``, SmolLM2's tokenizer, prompts
drawn without replacement as TRL's ``RepeatSampler`` does). Completions are not generated: a completion's
length is its question's reference solution length in tokens times a log-normal factor (sigma
``--spread``, so the completions of one prompt vary around a length that depends on the problem), clipped
to ``[1, max_completion_length]``. A completion's cost is its prompt + completion tokens.

Printed per world size: the heaviest rank's tokens over the mean rank's, summed over the steps
(``imbalance``: the time every rank spends at the pace of the heaviest, if time follows tokens), the worst
step, and the share of rank-time spent waiting at the all-reduce (``1 - mean / heaviest``).

Run::

    python benchmarks/grpo_rank_balance.py                 # 2, 4 and 8 ranks, 200 steps each
    python benchmarks/grpo_rank_balance.py --json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from smart_batching.data.tokenizers import load_tokenizer
from smart_batching.hf.grpo.ranks import deal_to_ranks

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def lengths(path: Path = GSM8K) -> tuple[np.ndarray, np.ndarray] | None:
    """``(prompt tokens, reference solution tokens)`` per GSM8K train problem, or None without the data."""
    if not path.exists():
        print(f"grpo_rank_balance: {path} is absent: nothing to run")
        return None
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    tok = load_tokenizer("smollm2")
    prompts = tok([f"Question: {r['question']}\nAnswer:" for r in rows])["input_ids"]
    answers = tok([r["answer"] for r in rows])["input_ids"]
    return np.array([len(p) for p in prompts]), np.array([len(a) for a in answers])


def simulate(prompt: np.ndarray, answer: np.ndarray, args: argparse.Namespace, world: int) -> dict:
    """Per step, every rank's tokens under TRL's deal and after dealing again."""
    rng = np.random.default_rng(args.seed)
    per_rank = args.per_device * args.steps_per_generation  # completions per rank per step
    groups = world * per_rank // args.num_generations  # prompts per step, all ranks
    before, after = [], []
    order = rng.permutation(prompt.size)
    for step in range(args.steps):
        problems = order[(step * groups) % prompt.size :][:groups]
        problem = np.repeat(problems, args.num_generations)  # TRL's sampler: each prompt G times in a row
        noise = rng.lognormal(0.0, args.spread, size=problem.size)
        completion = np.clip(np.rint(answer[problem] * noise), 1, args.max_completion_length).astype(np.int64)
        cost = prompt[problem] + completion  # (world * per_rank,)
        _, trl, dealt = deal_to_ranks(cost, world)  # TRL's deal: contiguous slices (kept where as even)
        before.append(trl)
        after.append(dealt)
    b, a = np.array(before, dtype=float), np.array(after, dtype=float)
    return {
        "world": world,
        "steps": args.steps,
        "completions_per_rank_step": per_rank,
        "trl": _summary(b),
        "balanced": _summary(a),
        "tokens_equal": bool(np.allclose(b.sum(1), a.sum(1))),
    }


def _summary(rank_tokens: np.ndarray) -> dict:
    heaviest, mean = rank_tokens.max(1), rank_tokens.mean(1)
    return {
        "imbalance": float(heaviest.sum() / mean.sum()),
        "worst_step": float((heaviest / mean).max()),
        "waiting": float(1.0 - mean.sum() / heaviest.sum()),
    }


def table(records: list[dict]) -> str:
    lines = [
        "| ranks | completions per rank per step | TRL's deal: imbalance | worst step | waiting | "
        "balance_ranks: imbalance | worst step | waiting |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        t, s = r["trl"], r["balanced"]
        lines.append(
            f"| {r['world']} | {r['completions_per_rank_step']} | {t['imbalance']:.3f} | {t['worst_step']:.3f} | "
            f"{100 * t['waiting']:.1f} % | {s['imbalance']:.4f} | {s['worst_step']:.4f} | {100 * s['waiting']:.2f} % |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--per-device", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--steps-per-generation", type=int, default=4, help="= gradient_accumulation_steps")
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--spread", type=float, default=0.35, help="log-normal sigma of completion lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    found = lengths()
    if found is None:
        return []
    records = [simulate(*found, args, int(w)) for w in args.worlds.split(",")]
    print("\n".join(json.dumps(r) for r in records) if args.json else table(records))
    return records


if __name__ == "__main__":
    main()
