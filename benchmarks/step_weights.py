"""How much does each strategy's plan weigh each token, and how alike are the examples of a step?

No training: the plans of the bench's step-matched budgets (``run_bench(match_steps=True)``), seeds
0..4, on the first N examples of a dataset tokenised as the bench does. Per strategy:

* ``cv_targets``: the coefficient of variation of target tokens per optimizer step. A step's loss is
  the mean over its own target tokens (HF ``num_items_in_batch``), so a token in a step with few
  targets weighs more than one in a step with many; random batches keep this near the sampling noise.
* ``weight_by_quartile``: the epoch's total weight on the tokens of each quarter of the examples by
  length (shortest first; quarters by rank, :func:`smart_batching.analysis.token_weights`, as the bench
  records it), relative to their share of the target tokens (1.0: uniform per token, as
  one mean over the whole epoch would weigh them). This is also the weight when clipping binds at every
  step (each step then moves the model by one clipped update, whatever its targets), up to each step's
  own gradient norm. A row with ``[loss_normalization=epoch]`` (:mod:`smart_batching.hf.step_weight`)
  scales each step's clipped update by its targets over the mean, which makes every weight 1.0 by
  construction; whether that trains better is for the study to measure.
* ``between_step_variance``: the share of the variance of example lengths that lies between steps
  (about 1 / batch size for random batches, 1.0 when every step holds equal lengths).
* ``first_step_length``: the first step's mean example length over the mean (the costliest-first
  rule puts the largest batch first).

``--grad-norms K``: instead, train K steps of random batches (AdamW, the bench's learning rate) on
SmolLM2's first ``--layers`` layers and print each step's gradient norm before clipping: where it is
above ``max_grad_norm`` (1.0 in the bench) at every step, clipping gives every step an update of the
same norm, and no loss normalisation (per step or per epoch) changes what the model learns.

Usage::

    python benchmarks/step_weights.py --data ../shared/data/gsm8k/train.jsonl --num-examples 240 --batch-size 16
    python benchmarks/step_weights.py --data humaneval.jsonl --num-examples 128 --batch-size 8 --json
    python benchmarks/step_weights.py --data humaneval.jsonl --batch-size 8 --grad-norms 6 --layers 2
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

STRATEGIES = (
    "random", "group_by_length", "token_budget", "packed", "packed[auto]", "packed[spread]", "packed[window=32]",
    "group_by_length[window=32]", "packed[costliest_first=False]", "token_budget[costliest_first=False]",
    "group_by_length[loss_normalization=epoch]", "packed[algorithm=auto,loss_normalization=epoch]",
    "group_by_length[mix_steps=2]",
)  # fmt: skip
"""``packed`` is its default, ``spread_fit`` (rows of mixed lengths); ``packed[auto]`` the tightest rows.
``group_by_length[mix_steps=2]``: a step is two micro-batches of half the batch, one from each length
stratum (``SmartBatchingTrainer(mix_steps=True)``), as the bench runs it."""


def step_weights(
    lengths: np.ndarray, targets: np.ndarray, strategy: str, batch_size: int, seeds: range = range(5)
) -> dict[str, Any]:
    """The measures of the module docstring for one strategy (means over ``seeds``)."""
    from smart_batching.analysis import token_weights
    from smart_batching.bench.runner import _resolve_sizes, matched_budgets
    from smart_batching.bench.training import row_segment_steps, strategy_options, trainer_row_options
    from smart_batching.planners import plan_batches

    mt, cap = _resolve_sizes(lengths, batch_size, None, None)
    budgets = matched_budgets(lengths, [strategy], batch_size, mt, cap, seeds)
    base, options = strategy_options(
        strategy, batch_size=batch_size, max_tokens=mt, capacity=cap, budgets=budgets
    )
    epoch_norm = trainer_row_options(strategy).get("loss_normalization") == "epoch"
    per_seed = []
    for seed in seeds:
        plan = plan_batches(lengths, base, seed=seed, **options)
        of_step = row_segment_steps(strategy, plan, seed)  # None: one batch a step
        if of_step is None:
            steps = [np.asarray(b) for b in plan]
        else:
            steps = [plan.example_ids[of_step == k] for k in range(int(of_step.max()) + 1)]
        per_step = np.array([targets[b].sum() for b in steps], dtype=np.float64)  # (steps,)
        ex = np.concatenate(steps)
        # The bench's own measure (its records' token_weights). loss_normalization="epoch" scales a
        # step's update by its targets over the mean, which cancels the 1 / targets: 1.0 by construction.
        share = token_weights(plan, targets, of_step)
        if epoch_norm:
            share = [v if np.isnan(v) else 1.0 for v in share]
        x = lengths[ex].astype(np.float64)
        grand = x.mean()
        between = sum(len(b) * (lengths[b].mean() - grand) ** 2 for b in steps)
        per_seed.append(
            {
                "cv_targets": float(per_step.std() / per_step.mean()),
                "weight_by_quartile": share,
                "between_step_variance": float(between / ((x - grand) ** 2).sum()),
                "first_step_length": float(lengths[steps[0]].mean() / grand),
                "steps": len(steps),
                "efficiency": float(plan.stats().efficiency),
            }
        )
    return {
        "strategy": strategy,
        "steps": per_seed[0]["steps"],
        "cv_targets": float(np.mean([p["cv_targets"] for p in per_seed])),
        "weight_by_quartile": [
            float(v) for v in np.mean([p["weight_by_quartile"] for p in per_seed], axis=0)
        ],
        "between_step_variance": float(np.mean([p["between_step_variance"] for p in per_seed])),
        "first_step_length": float(np.mean([p["first_step_length"] for p in per_seed])),
        "efficiency": float(np.mean([p["efficiency"] for p in per_seed])),
    }


def grad_norms(
    data: Any, tokenizer_model: Any, steps: int, batch_size: int, lr: float
) -> list[dict[str, float]]:
    """Loss and gradient norm (before clipping) of ``steps`` AdamW steps on consecutive batches."""
    import torch

    from smart_batching.collate import PaddingCollator

    torch.manual_seed(0)
    model = tokenizer_model.fresh("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    out = []
    for step in range(steps):
        rows = [data.train[i % data.num_train] for i in range(step * batch_size, (step + 1) * batch_size)]
        batch = PaddingCollator(0)(rows)
        labels = batch.pop("labels")
        loss = model(**batch, labels=labels).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        out.append({"step": step + 1, "loss": float(loss.detach()), "grad_norm": float(norm)})
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from smart_batching.bench.measure import example_targets
    from smart_batching.data.tasks import prepare_training_data
    from smart_batching.data.tokenizers import load_tokenizer
    from smart_batching.planners import split_strategies

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a data file the bench reads")
    parser.add_argument("--num-examples", type=int, default=240)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=None)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--json", action="store_true", help="one JSON line per strategy")
    parser.add_argument(
        "--grad-norms", type=int, default=0, metavar="K", help="train K steps, print grad norms"
    )
    parser.add_argument("--layers", type=int, default=2, help="SmolLM2 layers for --grad-norms")
    parser.add_argument("--lr", type=float, default=3e-4, help="learning rate for --grad-norms")
    opts = parser.parse_args(argv)
    if opts.grad_norms:
        import torch

        from smart_batching.models.zoo import load_training_model

        torch.set_num_threads(1)
        bm = load_training_model("smollm2", model_options={"num_hidden_layers": opts.layers})
        data = prepare_training_data(
            opts.data, tokenizer=bm.tokenizer, num_examples=opts.num_examples, eval_examples=8, num_prompts=0,
            max_length=opts.max_length,
        )  # fmt: skip
        rows = grad_norms(data, bm, opts.grad_norms, opts.batch_size, opts.lr)
        for r in rows:
            print(
                json.dumps(r)
                if opts.json
                else f"step {r['step']}: loss {r['loss']:.3f}, grad norm {r['grad_norm']:.2f}"
            )
        return rows
    data = prepare_training_data(
        opts.data, tokenizer=load_tokenizer("smollm2"), num_examples=opts.num_examples, eval_examples=8,
        num_prompts=0, max_length=opts.max_length,
    )  # fmt: skip
    lengths = data.lengths
    targets = example_targets(data)  # the tokens after the prompt; the first token is never a target
    rows = [
        {"data": opts.data, **step_weights(lengths, targets, s, opts.batch_size)}
        for s in split_strategies(opts.strategies)
    ]
    if opts.json:
        for r in rows:
            print(json.dumps(r))
        return rows
    print(
        f"{opts.data}: {len(lengths)} examples, mean length {lengths.mean():.0f}, target tokens mean "
        f"{targets.mean():.0f} (correlation with length {np.corrcoef(lengths, targets)[0, 1]:.2f})"
    )
    print(f"  {'strategy':<32} {'steps':>5} {'CV targets/step':>15} {'weight / token share, Q1..Q4':>30} "
          f"{'between-step var':>16} {'first step len':>14} {'efficiency':>10}")  # fmt: skip
    for r in rows:
        q = " ".join(f"{v:.2f}" for v in r["weight_by_quartile"])
        print(f"  {r['strategy']:<32} {r['steps']:>5} {r['cv_targets']:>15.2f} {q:>30} "
              f"{r['between_step_variance']:>16.2f} {r['first_step_length']:>14.2f} {r['efficiency']:>10.1%}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
