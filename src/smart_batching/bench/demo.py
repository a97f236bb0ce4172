"""The training bench of ``smart-batching demo`` (``make demo``): a real model learning, and what it says.

:func:`run_demo_bench` fine-tunes pretrained SmolLM2-135M-Instruct on the first examples of the embedded
default dataset (Python's own documentation: ``Document `json.dumps`.`` and its signature, answered
with the docstring), truncated short, with only the last decoder layers and the final norm trained
(:data:`DEMO_CONFIG`; the backward pass stops early, which is what makes a 135M model fit the time):

1. once per strategy of :data:`DEMO_STRATEGIES` on one process, from the same weights on the same
   examples (:func:`~smart_batching.bench.runner.run_bench`);
2. once more with :data:`DEMO_DISTRIBUTED` on :data:`DEMO_NPROC` processes (torchrun, gloo on CPU; on
   a machine with fewer GPUs than processes this run trains on the CPU), each example once, on one
   of the processes, each process's batch a half of the one-process batch (so a step holds about as
   many tokens and the fine-tune takes about as many steps), with the per-step balance of the
   processes' work recorded (:func:`distributed_config`);
3. renders one report whose first section, :func:`demo_lead`, holds what a person came for: speed-up,
   padding, memory, held-out loss before and after, the time to one-process ``random``'s final held-out
   loss with the plot of held-out loss against training time (:data:`EVAL_EVERY`), then the greedy generations of the initial
   weights and of every run side by side for a few held-out prompts; the benches' full sections
   follow. :func:`demo_text` is the same on the console.

The other strategies are left out to fit ``make demo`` in 5 minutes on 2 CPU cores with set-up;
:func:`rest_command` is the ``smart-batching bench`` command that runs them with the same settings.
"""

from __future__ import annotations

import functools
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from smart_batching.bench.config import BenchConfig
from smart_batching.planners import BASELINE_STRATEGY, DEFAULT_STRATEGY, FASTEST_STRATEGY, STRATEGIES

DEMO_STRATEGIES = (BASELINE_STRATEGY, DEFAULT_STRATEGY, FASTEST_STRATEGY)
"""The strategies of the one-process bench: the baseline (``random``), the default (``token_budget``) and
the one that saves the most padding (``packed``)."""
DEMO_DISTRIBUTED = FASTEST_STRATEGY
"""The strategy trained again on :data:`DEMO_NPROC` processes."""
DEMO_NPROC = 2
EVAL_EVERY = "1600tok"
"""The held-out curve's cadence: one evaluation about halfway through each one-process run (64 examples of
at most 64 tokens are about 3,100 real tokens), besides the initial and the final one every run has. An
evaluation is a forward pass of the whole model over the held-out set, about a sixth of such a run's
compute, so more points would cost more than they show."""

DEMO_CONFIG = BenchConfig(
    data="default",
    model="smollm2",
    model_options={"trainable_layers": 8},
    strategies=DEMO_STRATEGIES,
    seeds=(0,),
    num_examples=64,
    batch_size=8,
    max_length=64,
    lr=5e-4,
    eval_examples=16,
    num_generations=3,
    max_new_tokens=20,
    eval_every=EVAL_EVERY,
    render=False,
)
"""What the one-process demo bench runs (``out_dir``, ``progress`` and the loaded model are set per
call); the distributed bench is the same with ``strategies=(DEMO_DISTRIBUTED,)`` and ``nproc=DEMO_NPROC``."""


class DemoResult(NamedTuple):
    """What :func:`run_demo_bench` wrote and the text it shows."""

    records: Path
    report: Path
    text: str


def distributed_device(config: BenchConfig) -> Any:
    """The device of the distributed run: the bench's, unless it is CUDA with fewer GPUs than
    :data:`DEMO_NPROC` (a one-GPU box runs the demo unchanged: that run goes to the CPU)."""
    import torch

    if config.device is not None:
        return config.device
    if torch.cuda.is_available() and torch.cuda.device_count() >= DEMO_NPROC:
        return None
    return "cpu"


def distributed_config(config: BenchConfig, *, device: Any = None) -> BenchConfig:
    """The distributed bench of a demo config: :data:`DEMO_DISTRIBUTED` on :data:`DEMO_NPROC` processes,
    appended to the same records, each process's batch (``batch_size``, and ``max_tokens`` / ``capacity``
    when given) divided by the processes, so that an optimizer step takes about as many tokens as one
    step of the one-process runs and the fine-tune takes about as many steps."""

    def share(value: int | None) -> int | None:
        return None if value is None else max(1, value // DEMO_NPROC)

    return config.replace(
        strategies=(DEMO_DISTRIBUTED,),
        nproc=DEMO_NPROC,
        batch_size=share(config.batch_size),
        max_tokens=share(config.max_tokens),
        capacity=share(config.capacity),
        threads=None,
        device=device,
        eval_every=None,  # evaluation runs in the bench process, after training (not in the ranks)
        append=True,
    )


def run_demo_bench(
    out_dir: str | os.PathLike, *, progress: bool = True, config: BenchConfig = DEMO_CONFIG
) -> DemoResult:
    """Run the demo benches (one process, then :data:`DEMO_NPROC`) and render the demo report.

    Args:
        out_dir: folder for ``records.jsonl``, ``report.md``, ``report.html`` and the plots (a previous
            demo's records there are replaced).
        progress: progress lines (and bars on a terminal) on stderr.
        config: the one-process bench (:data:`DEMO_CONFIG`; a smaller one for tests); the distributed
            bench trains :data:`DEMO_DISTRIBUTED` with the same settings.

    Returns:
        The records, the self-contained HTML report, and the text for the console (:func:`demo_text`).
        After Ctrl-C the finished runs are kept and reported.
    """
    from smart_batching.bench.report import render_report
    from smart_batching.bench.runner import RECORDS_NAME, read_records, run_bench
    from smart_batching.models.zoo import load_training_model

    out = Path(out_dir)
    start = time.perf_counter()
    # One load for both benches (SmolLM2: seconds from the cache, about 30 s the first time).
    if progress:
        first = (
            " (the first time, its GGUF file is converted: about 30 s)" if config.model == "smollm2" else ""
        )
        print(f"loading model {config.model}{first} ...", file=sys.stderr, flush=True)
    model = load_training_model(
        config.model,
        tokenizer=config.tokenizer,
        model_options=dict(config.model_options) if config.model_options is not None else None,
    )
    single = config.replace(model=model, model_options=None, out_dir=out, progress=progress, append=False)
    records = run_bench(single)
    if len(records) == len(single.strategies):  # not interrupted
        run_bench(distributed_config(single, device=distributed_device(config)))
    records_path = out / RECORDS_NAME
    if not records_path.exists():
        raise KeyboardInterrupt  # interrupted before the first run finished: nothing to report
    lead = functools.partial(demo_lead, config=config)
    paths = render_report(records_path, out, title="smart-batching demo", lead=lead)
    text = demo_text(read_records(records_path), config)
    text += f"\n\n(benches took {time.perf_counter() - start:.0f} s)"
    return DemoResult(records_path, paths.html, text)


# --------------------------------------------------------------------------------------------------
# What the demo shows: rows and generations from the records
# --------------------------------------------------------------------------------------------------


def _device(record: dict[str, Any]) -> str:
    return str((record.get("settings") or {}).get("device") or "?")


def run_label(record: dict[str, Any], *, device: bool = False) -> str:
    """``packed``, or ``packed, 2 processes`` for a run on several; ``device=True`` adds the torch device
    (``packed, 2 processes, cpu``: on a one-GPU machine the multi-process run trains on the CPU)."""
    n = record.get("world_size") or 1
    return (
        record["strategy"]
        + (f", {n} processes" if n > 1 else "")
        + (f", {_device(record)}" if device else "")
    )


def _ok(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("status") == "ok"]


def headline_rows(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One row per run: steps, wall time, speed-up over one-process ``random`` (same tokens, same cores),
    padding, peak memory, held-out loss before and after, the time to ``random``'s final held-out loss
    (:func:`time_to_target_cell`), the weight of a target token per length quarter (``token_weights``) and
    the processes' balance."""
    ok = _ok(records)
    base = _baseline(records)
    devices = len({_device(r) for r in ok}) > 1  # then a speed-up across devices means nothing
    headers = ["run", "steps", "wall s", "speed-up", "padding", "peak MB", "held-out loss", "change",
               "to target", "token weight, short -> long", "rank balance"]  # fmt: skip
    rows = []
    for r in ok:
        before = (r.get("eval_initial") or {}).get("loss")
        after = (r.get("eval") or {}).get("loss")
        bal = r.get("rank_balance")
        rows.append(
            [
                run_label(r, device=devices),
                str(r["num_steps"]),
                f"{r['wall_seconds']:.1f}",
                f"{base['wall_seconds'] / r['wall_seconds']:.2f}x"
                if base and _device(base) == _device(r)
                else "-",
                f"{100 * r['padding_ratio']:.1f}%",
                f"{r.get('peak_memory_mb') or 0:,.0f}",
                "-" if before is None or after is None else f"{before:.3f} -> {after:.3f}",
                "-" if not before or after is None else f"{100 * (after - before) / before:+.1f}%",
                time_to_target_cell(r, records),
                " ".join("-" if w is None else f"{w:.2f}" for w in r["token_weights"])
                if r.get("token_weights")
                else "-",
                f"{bal['mean']:.2f} (worst {bal['max']:.2f})" if bal else "-",
            ]
        )
    return headers, rows


def _baseline(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The one-process ``random`` run: every other run is compared with it."""
    return next(
        (r for r in _ok(records) if r["strategy"] == BASELINE_STRATEGY and (r.get("world_size") or 1) == 1),
        None,
    )


def target_loss(records: list[dict[str, Any]]) -> float | None:
    """The demo's target: the final held-out loss of the one-process ``random`` run (None without one)."""
    base = _baseline(records)
    return None if base is None else (base.get("eval") or {}).get("loss")


def run_curve(record: dict[str, Any]) -> dict[str, Any]:
    """A run's held-out curve: its ``eval_curve``, or for a multi-process run (which evaluates only after
    training, in the bench process) the two points it has, the initial weights and the trained ones."""
    if record.get("eval_curve"):
        return record["eval_curve"]
    before, after = (record.get("eval_initial") or {}).get("loss"), (record.get("eval") or {}).get("loss")
    if before is None or after is None:
        return {}
    return {
        "step": [0, record["num_steps"]],
        "tokens": [0, record.get("real_tokens")],
        "wall_seconds": [0.0, record["wall_seconds"]],
        "cpu_seconds": [0.0, record.get("cpu_seconds")],
        "loss": [before, after],
    }


def time_to_target_cell(record: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """``12.3 s (0.85x)``: training wall seconds until the run's held-out loss first reached
    :func:`target_loss` (evaluations off the clock), and that over one-process ``random``'s; or why not."""
    from smart_batching.bench.curve import time_to_target

    goal, base = target_loss(records), _baseline(records)
    if goal is None or base is None:
        return "-"
    t = time_to_target(run_curve(record), goal)
    if not t["reached"]:
        return "not reached"
    b = time_to_target(run_curve(base), goal)
    ratio = (
        f" ({t['wall_seconds'] / b['wall_seconds']:.2f}x)"
        if b["reached"] and b["wall_seconds"] and _device(base) == _device(record)
        else ""
    )
    return f"{t['wall_seconds']:.1f} s{ratio}"


def generation_table(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per held-out prompt: ``{"prompt", "reference", "outputs": [(run, text), ...]}``, the initial weights'
    generation first (``before fine-tuning``), then every run's, in record order."""
    ok = _ok(records)
    if not ok:
        return []
    devices = len({_device(r) for r in ok}) > 1
    before = (ok[0].get("eval_initial") or {}).get("generations") or []
    prompts = ok[0].get("generations") or before
    table = []
    for k, g in enumerate(prompts):
        outputs = [("before fine-tuning", before[k].get("output", ""))] if k < len(before) else []
        for r in ok:
            gens = r.get("generations") or []
            if k < len(gens):
                outputs.append((run_label(r, device=devices), gens[k].get("output", "")))
        table.append({"prompt": g.get("prompt", ""), "reference": g.get("reference"), "outputs": outputs})
    return table


def rest_command(config: BenchConfig = DEMO_CONFIG, out: str = "out/demo/rest") -> str:
    """The ``smart-batching bench`` command that runs the strategies the demo leaves out, with its settings."""
    rest = [s for s in STRATEGIES if s not in config.strategies]
    args = ["smart-batching", "bench", "--data", str(config.data), "--model", str(config.model)]
    if isinstance(config.tokenizer, str):
        args += ["--tokenizer", config.tokenizer]
    for key, value in (config.model_options or {}).items():
        args += ["--model-option", f"{key}={value}"]
    args += ["--strategies", ",".join([BASELINE_STRATEGY, *rest])]
    for flag, value in (
        ("--num-examples", config.num_examples),
        ("--batch-size", config.batch_size),
        ("--max-length", config.max_length),
        ("--lr", config.lr),
        ("--eval-examples", config.eval_examples),
        ("--num-generations", config.num_generations),
        ("--max-new-tokens", config.max_new_tokens),
    ):
        if value is not None:
            args += [flag, str(value)]
    return shlex.join([*args, "--out", out])


def _model_sentence(records: list[dict[str, Any]]) -> str:
    first = _ok(records)[0] if _ok(records) else records[0]
    s, data = first.get("settings") or {}, first.get("data") or {}
    info = s.get("model_info") or {}
    trainable = (info.get("model_options") or {}).get("trainable_layers")
    total, params = info.get("num_hidden_layers"), info.get("num_parameters") or 0
    trained = info.get("num_trainable_parameters")
    what = (
        f"its last {trainable} of {total} decoder layers and the final norm trained ({trained:,} of {params:,} "
        "parameters), the rest frozen"
        if trainable is not None and trained is not None
        else f"all {params:,} parameters trained"
    )
    trunc = data.get("truncation") or {}
    return (
        f"`{first.get('model')}` ({info.get('class')}), {what}; {data.get('num_train')} training examples of "
        f"`{data.get('source')}` truncated at {trunc.get('max_length')} tokens, {s.get('epochs')} epoch(s), batch_size "
        f"{s.get('batch_size')}, "
        f"lr {s.get('lr')}; every run starts from the same weights and trains on the same examples. Held-out loss "
        f"on {data.get('num_eval')} examples; greedy generations of up to {s.get('max_new_tokens')} tokens."
    )


# --------------------------------------------------------------------------------------------------
# The report's lead section and the console text
# --------------------------------------------------------------------------------------------------


def demo_lead(
    doc: Any, records: list[dict[str, Any]], out: Path, *, config: BenchConfig = DEMO_CONFIG
) -> list[Path]:
    """The demo report's first section (a :data:`~smart_batching.bench.report.Lead`); ``config`` is the
    demo's, for the command that runs the strategies it left out."""
    ok = _ok(records)
    doc.h(2, "What the demo shows")
    if not ok:
        doc.p("No run finished.")
        return []
    doc.p(_model_sentence(records))
    target = target_loss(records)
    goal = "one-process `random`'s final held-out loss" + ("" if target is None else f" ({target:.3f})")
    headers, rows = headline_rows(records)
    doc.table(headers, rows)
    doc.ul(
        [
            "`speed-up`: one-process `random`'s wall time over the run's (every run trains the same tokens; the "
            "multi-process run shares the same cores between its processes). `padding`: share of the token slots "
            "the model computed that were padding. `peak MB`: the largest process's peak memory.",
            "`held-out loss`: mean cross-entropy per target token on the held-out examples, of the initial weights "
            "and after the run; `change` in %. One seed: differences between strategies of about a percent are "
            "within what another seed gives.",
            f"`to target`: training wall seconds until the run's held-out loss first reached {goal}, and that "
            "over `random`'s. It is read at the evaluations: the initial weights, "
            f"{_cadence(ok)}, and the end (evaluations off the clock; the multi-process run evaluates only at its "
            "end), so a run that gets there only at its end shows its whole training time.",
            "`token weight, short -> long`: per quarter of the training examples by length, shortest first, the "
            "weight its target tokens get in the run's plan over their share of the targets (a step's loss is the "
            "mean over its own targets, so a token weighs one over its step's targets; 1.00 is uniform). Steps of "
            "like lengths weigh the short examples' tokens more; `packed` fills every row with examples of "
            'mixed lengths (its default, `algorithm="spread_fit"`) to keep them level.',
            "`rank balance`: per optimizer step, the busiest process's token slots over the mean process's (1.00 is "
            "even; a step waits for its slowest process), the mean over the steps and the worst step.",
        ]
    )
    plots = _time_to_target_plot(doc, records, out)
    doc.h(3, "What the model says, before and after")
    doc.p(
        "Held-out prompts, the same for every run; greedy decoding of the initial weights (`before fine-tuning`) "
        "and of each run's trained weights, with the held-out docstring the data gives. Fine-tuning moves the "
        "answers from a chat assistant's toward the training data's docstrings; the runs should agree in kind, "
        "since only the batching differed."
    )
    for k, g in enumerate(generation_table(records)):
        doc.p(f"**Prompt {k + 1}:**")
        doc.pre(g["prompt"].strip())
        if g.get("reference"):
            doc.p("Held-out answer: " + _one_line(g["reference"], 300))
        doc.table(
            ["run", "generation"], [[name, _one_line(text, 600)] for name, text in g["outputs"]], wrap=True
        )
    multi = [r for r in ok if r.get("rank_balance")]
    if multi:
        r = multi[0]
        bal = r["rank_balance"]
        n = r.get("world_size")
        doc.h(3, f"{run_label(r)}: the processes' work, step by step")
        doc.p(
            f"Each optimizer step every process trains its own micro-batch of the one balanced plan (batch_size "
            f"{(r.get('settings') or {}).get('batch_size')} and capacity {(r.get('settings') or {}).get('capacity')} "
            f"per process: a step holds about as many tokens as a one-process step), and the step waits for the "
            f"slowest process. Token slots (rows x padded width) per process and step, as measured: "
            f"balance {bal['mean']:.2f} on average, {bal['max']:.2f} at worst."
        )
        head = ["step", *(f"process {i}" for i in range(n)), "max / mean"]
        body = [
            [str(i + 1), *(f"{v:,}" for v in slots), f"{ratio:.2f}"]
            for i, (slots, ratio) in enumerate(zip(bal["slots"], bal["per_step"], strict=True))
        ]
        doc.table(head, body)
    doc.p(
        "Strategies the demo leaves out (to fit 5 minutes on 2 CPU cores), with the same settings: "
        f"`{rest_command(config)}`."
    )
    return plots


def _cadence(ok: list[dict[str, Any]]) -> str:
    every = next(
        ((r.get("eval_curve") or {}).get("every") for r in ok if (r.get("eval_curve") or {}).get("every")),
        None,
    )
    if not every:
        return "each epoch's end"
    return (
        f"every {every['steps']} step{'' if every['steps'] == 1 else 's'}"
        if every.get("steps")
        else f"every {every['tokens']:,} real training tokens"
    )


def _time_to_target_plot(doc: Any, records: list[dict[str, Any]], out: Path) -> list[Path]:
    """Held-out loss against training time of the one-process runs (the multi-process run has only its
    start and end), with one-process ``random``'s final loss as the target line."""
    from smart_batching.bench.plots import plot_time_to_quality

    single = [r for r in _ok(records) if (r.get("world_size") or 1) == 1 and r.get("eval_curve")]
    if not single:
        return []
    doc.h(3, "Held-out loss during training")
    path = plot_time_to_quality(
        single,
        out / "demo-time-to-target.png",
        target=target_loss(records),
        title="Held-out loss against training time, one process (1 seed; evaluations off the clock)",
    )
    doc.img(path, "held-out loss against training wall time, one line per strategy")
    spent = [r["eval_overhead"]["wall_seconds"] for r in single if r.get("eval_overhead")]
    doc.p(
        "The dashed line is the target: one-process `random`'s final held-out loss. "
        + (
            f"Evaluating during training took {sum(spent):.1f} s over the {len(single)} runs, off their clocks."
            if spent
            else ""
        )
    )
    return [path]


def _one_line(text: str | None, limit: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def demo_text(records: list[dict[str, Any]], config: BenchConfig = DEMO_CONFIG) -> str:
    """The console's view of the demo: the headline table, the generations side by side, how to run the rest."""
    from smart_batching.bench.summary import _text_table

    ok = _ok(records)
    if not ok:
        return "no run finished"
    headers, rows = headline_rows(records)
    lines = [_text_table(headers, rows)]
    target = target_loss(records)
    if target is not None:
        lines.append(
            f"to target: training wall s until held-out loss first reached one-process random's final {target:.3f} "
            f"(evaluated at the start, {_cadence(ok)} and the end; x: over random's)"
        )
    lines.append("")
    for k, g in enumerate(generation_table(records)):
        lines.append(f"prompt {k + 1}: {_one_line(g['prompt'], 100)}")
        width = max(len(name) for name, _ in g["outputs"])
        lines += [f"  {name.ljust(width)}  {_one_line(text, 110)!r}" for name, text in g["outputs"]]
        lines.append("")
    fell = [
        r for r in ok if (r.get("eval") or {}).get("loss", 1e9) < (r.get("eval_initial") or {}).get("loss", 0)
    ]
    lines.append(
        "held-out loss fell in every run"
        if len(fell) == len(ok)
        else f"held-out loss fell in {len(fell)} of {len(ok)} runs"
    )
    lines.append(f"the other strategies, same settings: {rest_command(config)}")
    return "\n".join(lines)


__all__ = [
    "DEMO_CONFIG",
    "DEMO_DISTRIBUTED",
    "DEMO_NPROC",
    "DEMO_STRATEGIES",
    "DemoResult",
    "EVAL_EVERY",
    "demo_lead",
    "distributed_config",
    "demo_text",
    "generation_table",
    "headline_rows",
    "rest_command",
    "run_curve",
    "run_demo_bench",
    "target_loss",
    "time_to_target_cell",
]
