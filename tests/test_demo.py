"""``smart-batching demo``'s training bench (:mod:`smart_batching.bench.demo`).

Default tier: the demo report and console text from records of a real (tiny) bench, with a
two-process run added as its record would read; the command it prints for the strategies it leaves
out parses with the real command line. Slow tier: the demo end to end through the command line
(SmolLM2, about 3 minutes on 2 idle CPU cores): every run's generations before and after are text,
held-out loss falls in every run, and the two-process run trained on every example exactly once.
"""

from __future__ import annotations

import copy
import shlex

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from smart_batching.bench.demo import (  # noqa: E402
    DEMO_CONFIG,
    DEMO_DISTRIBUTED,
    DEMO_NPROC,
    demo_lead,
    demo_text,
    generation_table,
    headline_rows,
    rest_command,
    run_curve,
    target_loss,
)
from smart_batching.bench.multiprocess import rank_balance  # noqa: E402
from smart_batching.bench.records import append_record, read_records  # noqa: E402
from smart_batching.bench.report import render_report  # noqa: E402
from smart_batching.bench.runner import run_bench  # noqa: E402
from smart_batching.cli import build_parser, main  # noqa: E402
from smart_batching.planners import STRATEGIES  # noqa: E402

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "trainable_layers": 1}  # fmt: skip


@pytest.fixture(scope="module")
def demo_records(tmp_path_factory):
    """A real one-process bench (tiny Llama, random and packed) and the packed run again as a two-process
    run's record reads (another bench, world_size 2, its balance from two ranks' batches). The tiny
    model's generations are empty strings, so each gets a text naming its run."""
    out = tmp_path_factory.mktemp("demo")
    records = run_bench(
        "default", model="tiny-llama", model_options=TINY, strategies=("random", "packed"), num_examples=8,
        batch_size=4, max_length=64, eval_examples=4, num_generations=2, max_new_tokens=4, out_dir=out,
        render=False, progress=False, threads=1, eval_every=1,
    )  # fmt: skip
    two = copy.deepcopy(records[-1])
    two.update(bench_id="two-processes", run_index=0, world_size=2)
    two.pop("eval_curve")  # a multi-process run evaluates only after training
    two["token_weights"] = None  # ... and has no token weights (its steps are the balanced plan's)
    two["rank_balance"] = rank_balance(
        [{"slots": [60, 40], "real_tokens": [60, 40]}, {"slots": [40, 40], "real_tokens": [40, 40]}]
    )
    for r in (*records, two):
        r["generations"] = [{**g, "output": f"{r['strategy']}/{r['world_size']} says {k}"}
                            for k, g in enumerate(r["generations"])]  # fmt: skip
        r["eval_initial"]["generations"] = [
            {**g, "output": f"before {k}"} for k, g in enumerate(r["generations"])
        ]
    path = out / "records.jsonl"
    path.unlink()
    for r in (*records, two):
        append_record(path, r)
    return path


def test_the_demo_report_leads_with_the_runs_and_what_the_model_says(demo_records, tmp_path):
    import functools

    records = read_records(demo_records)
    paths = render_report(
        demo_records, tmp_path, title="smart-batching demo", lead=functools.partial(demo_lead)
    )
    md = paths.markdown.read_text()
    lead, benches = md.split("## tiny-llama", 1)  # the benches' own sections follow the lead
    assert "# smart-batching demo" in lead and "## What the demo shows" in lead
    assert "last 1 of 2 decoder layers and the final norm trained" in lead
    headers, rows = headline_rows(records)
    assert [r[0] for r in rows] == ["random", "packed", "packed, 2 processes"]
    assert rows[0][headers.index("speed-up")] == "1.00x"
    before = records[0]["eval_initial"]["loss"]
    for row, r in zip(rows, records, strict=True):
        assert row[headers.index("held-out loss")] == f"{before:.3f} -> {r['eval']['loss']:.3f}"
        assert ("(worst" in row[headers.index("rank balance")]) == (r["world_size"] == 2)
        weights = row[headers.index("token weight, short -> long")]
        if r["world_size"] == 1:
            assert len(r["token_weights"]) == 4 and weights == " ".join(
                f"{w:.2f}" for w in r["token_weights"]
            )
        else:  # several processes' steps are the balanced plan's: not measured
            assert r["token_weights"] is None and weights == "-"
        assert "| " + " | ".join(row) + " |" in lead
    for k in range(2):  # per prompt: the initial weights' generation, then every run's, side by side
        assert f"| before fine-tuning | before {k} |" in lead
        assert f"| random | random/1 says {k} |" in lead
        assert f"| packed, 2 processes | packed/2 says {k} |" in lead
    # The two-process run's work per step: 60 and 40 slots (balance 1.20), then 40 and 40 (1.00).
    assert "| 1 | 60 | 40 | 1.20 |" in lead and "| 2 | 40 | 40 | 1.00 |" in lead
    assert rest_command() in lead
    assert "before training: 'before 0'" in benches  # the bench sections show the initial weights' too
    html = paths.html.read_text()
    assert "<table class='wrap'>" in html and "packed/2 says 1" in html


def test_time_to_target_is_read_from_the_held_out_curves(demo_records, tmp_path):
    """``to target``: training seconds until a run's held-out loss first reached one-process random's final
    loss; the two-process run (no curve) reaches it at its end or not at all; the lead plots the curves."""
    import functools

    records = read_records(demo_records)
    target = records[0]["eval"]["loss"]
    assert target_loss(records) == target
    assert all(len(r["eval_curve"]["step"]) > 2 for r in records[:2])  # points between start and end
    assert run_curve(records[2])["loss"] == [records[2]["eval_initial"]["loss"], records[2]["eval"]["loss"]]
    headers, rows = headline_rows(records)
    cells = [row[headers.index("to target")] for row in rows]
    base = records[0]["eval_curve"]
    base_s = base["wall_seconds"][next(i for i, v in enumerate(base["loss"]) if v <= target)]
    assert cells[0] == f"{base_s:.1f} s (1.00x)"
    for r, cell in zip(records[1:], cells[1:], strict=True):
        curve = run_curve(r)
        hits = [i for i, v in enumerate(curve["loss"]) if v <= target]
        if not hits:
            assert cell == "not reached"
        else:
            s = curve["wall_seconds"][hits[0]]
            assert cell == f"{s:.1f} s ({s / base_s:.2f}x)"
    paths = render_report(demo_records, tmp_path, lead=functools.partial(demo_lead))
    lead = paths.markdown.read_text().split("## tiny-llama", 1)[0]
    assert "### Held-out loss during training" in lead and "demo-time-to-target.png" in lead
    assert (tmp_path / "demo-time-to-target.png").stat().st_size > 0
    assert f"one-process `random`'s final held-out loss ({target:.3f})" in lead
    assert "every 1 step," in lead and "to target: training wall s" in demo_text(records)


def test_demo_text_shows_the_runs_the_generations_and_the_rest(demo_records):
    records = read_records(demo_records)
    text = demo_text(records)
    assert "packed, 2 processes" in text and "1.00x" in text
    lines = text.splitlines()
    assert any(line.startswith("prompt 1: Document") for line in lines)
    rows = [line.split() for line in lines if line.startswith("  ")]  # the generations, one run a line
    assert ["before", "fine-tuning", "'before", "0'"] in rows
    assert ["packed,", "2", "processes", "'packed/2", "says", "1'"] in rows
    fell = all(r["eval"]["loss"] < r["eval_initial"]["loss"] for r in records)
    assert ("held-out loss fell in every run" in text) == fell
    table = generation_table(records)
    assert [name for name, _ in table[0]["outputs"]] == [
        "before fine-tuning",
        "random",
        "packed",
        "packed, 2 processes",
    ]


def test_a_run_on_another_device_is_labelled_and_not_compared(demo_records):
    """On a one-GPU machine the two-process run trains on the CPU: its row says so, with no speed-up."""
    records = read_records(demo_records)
    for r in records[:-1]:
        r["settings"]["device"] = "cuda"
    headers, rows = headline_rows(records)
    assert [r[0] for r in rows] == ["random, cuda", "packed, cuda", "packed, 2 processes, cpu"]
    assert [r[headers.index("speed-up")] for r in rows][::2] == ["1.00x", "-"]
    assert generation_table(records)[0]["outputs"][-1][0] == "packed, 2 processes, cpu"


def test_the_distributed_run_shares_the_batch_between_its_processes():
    """Each process takes 1/nproc of the one-process batch, so a step holds about as many tokens."""
    from smart_batching.bench.demo import distributed_config

    config = distributed_config(DEMO_CONFIG.replace(capacity=512), device="cpu")
    assert config.strategies == (DEMO_DISTRIBUTED,) and config.nproc == DEMO_NPROC and config.append
    assert config.batch_size == DEMO_CONFIG.batch_size // DEMO_NPROC and config.capacity == 512 // DEMO_NPROC
    assert config.max_tokens is None and config.device == "cpu"
    assert (config.num_examples, config.lr, config.model) == (
        DEMO_CONFIG.num_examples,
        DEMO_CONFIG.lr,
        "smollm2",
    )


def test_the_command_for_the_other_strategies_parses_with_the_same_settings():
    argv = shlex.split(rest_command())
    assert argv[:2] == ["smart-batching", "bench"]
    args = build_parser().parse_args(argv[1:])
    left_out = [s for s in STRATEGIES if s not in DEMO_CONFIG.strategies]
    assert left_out and args.strategies == ",".join(["random", *left_out])
    assert dict(args.model_options) == dict(DEMO_CONFIG.model_options)
    assert (args.model, args.num_examples, args.max_length, args.lr, args.batch_size) == (
        DEMO_CONFIG.model, DEMO_CONFIG.num_examples, DEMO_CONFIG.max_length, DEMO_CONFIG.lr, DEMO_CONFIG.batch_size,
    )  # fmt: skip


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, capsys):
    """``smart-batching demo``: generations before and after for every run, held-out loss falling in every
    run, and the two-process run trained on every example exactly once (same digest as one process)."""
    from smart_batching.bench.measure import examples_digest
    from smart_batching.data.tasks import prepare_training_data
    from smart_batching.data.tokenizers import load_tokenizer

    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    records = read_records(tmp_path / "bench" / "records.jsonl")
    assert [(r["strategy"], r["world_size"]) for r in records] == [
        *((s, 1) for s in DEMO_CONFIG.strategies),
        (DEMO_DISTRIBUTED, DEMO_NPROC),
    ]
    assert all(r["status"] == "ok" for r in records)
    for g in generation_table(records):
        assert len(g["outputs"]) == 1 + len(records)
        assert all(text.strip() for _, text in g["outputs"]), g["outputs"]
    assert all(r["eval"]["loss"] < r["eval_initial"]["loss"] for r in records)
    assert "held-out loss fell in every run" in out and "before fine-tuning" in out
    data = prepare_training_data(
        "default", tokenizer=load_tokenizer("smollm2"), num_examples=DEMO_CONFIG.num_examples,
        eval_examples=DEMO_CONFIG.eval_examples, max_length=DEMO_CONFIG.max_length, num_prompts=0,
    )  # fmt: skip
    expected = examples_digest(np.arange(data.num_train), data.lengths)
    assert {r["examples_digest"] for r in records} == {expected}
    two = records[-1]
    assert two["num_examples_seen"] == data.num_train and two["dropped"]["num_examples_not_seen"] == 0
    assert len(two["rank_balance"]["per_step"]) == two["num_steps"] and two["rank_balance"]["max"] >= 1.0
    for r in records[:-1]:  # the one-process runs evaluate once between their start and end, off the clock
        assert len(r["eval_curve"]["step"]) == 3 and 0 < r["eval_curve"]["step"][1] < r["num_steps"]
    md = (tmp_path / "bench" / "report.md").read_text()
    assert (
        md.index("What the demo shows")
        < md.index("### Held-out loss during training")
        < md.index("## smollm2")
    )
    assert (tmp_path / "bench" / "demo-time-to-target.png").stat().st_size > 0
    assert f"{DEMO_DISTRIBUTED}, {DEMO_NPROC} processes: the processes' work, step by step" in md
