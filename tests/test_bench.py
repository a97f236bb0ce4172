"""The training bench: records, same data per strategy, report rendering, Ctrl-C, CLI.

Default tier: micro benches (a 1-layer, 16-wide Llama on a dozen short GSM8K-shaped examples, a few
steps per strategy). The demo's bench is tested in test_demo.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("matplotlib")

from transformers import TrainerCallback  # noqa: E402

from smart_batching.bench.report import fmt_spread, speed_ratios, summary_table  # noqa: E402
from smart_batching.bench.runner import RECORD_FIELDS, read_records, run_bench  # noqa: E402
from smart_batching.cli import main  # noqa: E402
from smart_batching.data.tasks import gsm8k_answer, gsm8k_exact_match  # noqa: E402
from smart_batching.models import zoo as bench_models  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
MICRO = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
NUM_TRAIN = 12


def write_gsm8k_like(folder: Path) -> Path:
    """train.jsonl (+ test.jsonl next to it) of short question/answer records with `#### n` answers."""
    folder.mkdir(parents=True, exist_ok=True)
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    for name, n in (("train", NUM_TRAIN), ("test", 6)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for i in range(n):
                q = f"What is {i} plus {i % 3}? " + " ".join(words[: 1 + (i * 7) % 9])
                a = f"{i} + {i % 3} = {i + i % 3}.\n#### {i + i % 3}"
                f.write(json.dumps({"question": q, "answer": a}) + "\n")
    return folder / "train.jsonl"


@pytest.fixture(scope="module")
def micro_bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], str]:
    """One micro bench through the CLI with --json: random, max_length, packed; 3 steps each."""
    root = tmp_path_factory.mktemp("bench")
    train = write_gsm8k_like(root / "data")
    out = root / "out"
    mp = pytest.MonkeyPatch()
    for key, value in MICRO.items():
        mp.setitem(bench_models.TINY_LLAMA, key, value)
    import contextlib
    import io

    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            code = main(
                [
                    "bench", "--data", str(train), "--model", "tiny-llama", "--strategies", "random,max_length,packed",
                    "--max-steps", "3", "--batch-size", "4", "--eval-examples", "4", "--num-generations", "2",
                    "--max-new-tokens", "4", "--out", str(out), "--json", "--no-progress",
                ]
            )  # fmt: skip
    finally:
        mp.undo()
    assert code == 0
    lines = [json.loads(x) for x in stdout.getvalue().splitlines() if x.strip()]
    return out, lines, stdout.getvalue()


def test_records_written_and_complete(micro_bench):
    out, printed, _ = micro_bench
    records = read_records(out / "records.jsonl")
    assert [r["strategy"] for r in records] == ["random", "max_length", "packed"]
    assert [r["strategy"] for r in printed] == [
        "random",
        "max_length",
        "packed",
    ]  # --json: one record per line
    for r in records:
        assert r["status"] == "ok"
        missing = [f for f in RECORD_FIELDS if f not in r]
        assert not missing, missing
        assert r["task"] == "gsm8k"
        assert r["fallbacks"] == {}  # the tiny Llama on the CPU takes every default path
        assert r["versions"]["torch"] and r["versions"]["transformers"] and r["versions"]["smart_batching"]
        assert r["machine"]["cores"] >= 1 and r["machine"]["device"] == "cpu" and r["machine"]["cpu"]
        assert r["wall_seconds"] > 0 and r["tokens_per_second"] > 0 and r["samples_per_second"] > 0
        assert (
            r["step_seconds"]["n"] == r["num_steps"] and r["step_seconds"]["p90"] >= r["step_seconds"]["p50"]
        )
        assert r["peak_memory_mb"] > 0
        assert len(r["loss_curve"]["loss"]) == r["num_steps"]
        assert r["loss_curve"]["examples"][-1] == NUM_TRAIN
        assert r["eval"]["loss"] > 0 and r["eval"]["perplexity"] > 1
        assert r["eval_initial"]["loss"] > 0
        assert r["task_metric"]["name"] == "gsm8k_exact_match" and r["task_metric"]["total"] == 2
        assert len(r["generations"]) == 2 and "####" in r["generations"][0]["reference"]
        assert r["data"]["lengths"]["n"] == NUM_TRAIN and sum(r["data"]["histogram"]["counts"]) == NUM_TRAIN
        assert r["dropped"]["num_examples_not_seen"] == 0
        assert set(r["randomness"]) == {"order_corr", "pair_repeat", "pair_repeat_random"}
    # Batches of 4 of 12 examples: a pair shares a batch by chance with probability 3 / 11.
    assert records[0]["randomness"]["pair_repeat_random"] == pytest.approx(3 / 11)
    assert 0.0 <= records[2]["randomness"]["pair_repeat"] <= 1.0  # packed: rows are its groups


def test_every_strategy_sees_the_same_examples(micro_bench):
    out, _, _ = micro_bench
    records = read_records(out / "records.jsonl")
    assert len({r["examples_digest"] for r in records}) == 1
    assert {r["num_examples_seen"] for r in records} == {NUM_TRAIN}
    assert len({r["real_tokens"] for r in records}) == 1
    by = {r["strategy"]: r for r in records}
    assert by["packed"]["padding_ratio"] == 0.0
    # max_length pads every row to the longest example of the data.
    longest = by["max_length"]["data"]["lengths"]["max"]
    assert by["max_length"]["token_slots"] == NUM_TRAIN * longest
    assert by["max_length"]["token_slots"] >= by["random"]["token_slots"] > by["packed"]["token_slots"]
    # Same batches as random (same seed, same order), only wider: the same training.
    assert by["max_length"]["loss_curve"]["loss"] == pytest.approx(
        by["random"]["loss_curve"]["loss"], rel=1e-3
    )


def test_every_strategy_learns_from_the_completions_only(micro_bench):
    """The loss covers each answer and never its question: the data's prompt_length reaches the
    collator through the Trainer (HF's remove_unused_columns would drop it), for every strategy."""
    from smart_batching.data.tasks import prepare_training_data

    out, _, _ = micro_bench
    records = read_records(out / "records.jsonl")
    train = out.parent / "data" / "train.jsonl"
    tokenizer = bench_models.load_training_model("tiny-llama").tokenizer
    data = prepare_training_data(str(train), tokenizer=tokenizer, num_examples=NUM_TRAIN, eval_examples=4)
    prompts = data.train["prompt_length"]
    assert min(prompts) > 1  # there is a question to mask
    # Each example predicts its tokens after the prompt (a row's first token is predicted by nothing).
    expected = sum(len(ids) - max(p, 1) for ids, p in zip(data.train["input_ids"], prompts, strict=True))
    assert [r["target_tokens"] for r in records] == [expected] * len(records)
    assert expected < records[0]["real_tokens"] - NUM_TRAIN


def test_report_renders_markdown_html_and_pngs(micro_bench):
    out, _, stdout = micro_bench
    md, html = out / "report.md", out / "report.html"
    assert md.is_file() and html.is_file()
    pngs = sorted(out.glob("bench-*.png"))
    assert len(pngs) == 4
    for png in pngs:
        assert png.read_bytes()[:8] == PNG
    text = md.read_text()
    for word in (
        "random",
        "max_length",
        "packed",
        "x random",
        "pairs again",
        "truncated / dropped",
        "Machine",
        "torch",
    ):
        assert word in text
    assert "](bench-" in text  # linked PNGs
    page = html.read_text()
    assert page.count("data:image/png;base64,") == 4 and "<table>" in page


def test_report_cli_rerenders_from_records(micro_bench, tmp_path, capsys):
    out, _, _ = micro_bench
    assert main(["report", str(out / "records.jsonl"), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "report.html" in printed and "x random" in printed and "packed" in printed
    assert (tmp_path / "report.html").is_file() and (tmp_path / "report.md").is_file()
    assert len(list(tmp_path.glob("bench-*.png"))) == 4


def test_report_cli_refuses_missing_file(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope.jsonl")]) == 2
    assert "error:" in capsys.readouterr().err


class InterruptOnRun(TrainerCallback):
    """Raise KeyboardInterrupt when the n-th run starts training (1-based)."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.seen += 1
        if self.seen == self.n:
            raise KeyboardInterrupt


def test_keyboard_interrupt_keeps_finished_records(tmp_path):
    train = write_gsm8k_like(tmp_path / "data")
    records = run_bench(
        train, model="tiny-llama", model_options=MICRO, strategies=("random", "packed", "token_budget"),
        max_steps=2, batch_size=4, eval_examples=2, num_generations=1, max_new_tokens=2,
        out_dir=tmp_path / "out", progress=False, callbacks=[InterruptOnRun(2)],
    )  # fmt: skip
    assert [r["strategy"] for r in records] == ["random"]
    on_disk = read_records(tmp_path / "out" / "records.jsonl")
    assert [r["strategy"] for r in on_disk] == ["random"]
    assert (tmp_path / "out" / "report.html").is_file()  # rendered from what finished


PRECISION_BENCH = dict(
    model="tiny-llama", model_options=MICRO, strategies=("random", "packed"), max_steps=2, batch_size=4,
    eval_examples=2, num_generations=0, progress=False, render=False,
)  # fmt: skip


def test_precision_is_the_same_for_every_strategy_and_named_in_each_record(tmp_path, cpu_half_path):
    """``precision="bf16"`` trains every strategy under bf16 autocast (float32 weights), and each record
    says so with the CPU's bf16 support (forced here: each path), warned about off the native path."""
    train = write_gsm8k_like(tmp_path / "data")
    bf16 = run_bench(train, precision="bf16", out_dir=tmp_path / "bf16", **PRECISION_BENCH)
    assert [r["precision"]["autocast"] for r in bf16] == ["bfloat16", "bfloat16"]
    assert {r["settings"]["precision"] for r in bf16} == {"bf16"}
    assert all(r["precision"]["setting"] == "bf16" for r in bf16)
    assert [(r["precision"]["cpu_bf16"], r["precision"]["cpu_bf16_forced"]) for r in bf16] == [
        (cpu_half_path, True)
    ] * 2
    assert [r["precision"]["dtype"] for r in bf16] == ["float32", "float32"]
    slow = [] if cpu_half_path == "native" else ["precision.cpu_half"]
    assert [sorted(r["fallbacks"]) for r in bf16] == [slow] * 2


def test_precision_on_cpu_is_float32_by_default(tmp_path):
    train = write_gsm8k_like(tmp_path / "data")
    default = run_bench(train, out_dir=tmp_path / "auto", **PRECISION_BENCH)
    assert [(r["precision"]["setting"], r["precision"]["autocast"]) for r in default] == [("fp32", None)] * 2


def _record(strategy: str, seed: int, tps: float, loss: float) -> dict:
    return {
        "bench_id": "b", "status": "ok", "strategy": strategy, "seed": seed, "tokens_per_second": tps,
        "num_steps": 3, "num_examples_seen": 12, "wall_seconds": 1000 / tps, "cpu_seconds": 2000 / tps,
        "samples_per_second": 1.0,
        "step_seconds": {"p50": 0.1, "p90": 0.2}, "padding_ratio": 0.5, "token_slots": 100, "peak_memory_mb": 10.0,
        "train_loss_final": 1.0, "eval": {"loss": loss, "perplexity": 2.0}, "task_metric": None, "dropped": {},
        "model": "m", "task": "lm", "data": {"source": "d"}, "settings": {}, "machine": {"cpu": "x", "cores": 2},
        "randomness": {"order_corr": 0.0, "pair_repeat": 0.5 if strategy == "packed" else 0.002, "pair_repeat_random": 0.1},
    }  # fmt: skip


def test_ratios_and_spread_from_synthetic_records():
    records = [
        _record("random", 0, 100.0, 2.0), _record("packed", 0, 300.0, 2.2),
        _record("random", 1, 200.0, 2.0), _record("packed", 1, 400.0, 2.4),
    ]  # fmt: skip
    ratios = speed_ratios(records)
    assert ratios["random"] == [1.0, 1.0] and ratios["packed"] == pytest.approx([3.0, 2.0])
    assert speed_ratios(records, key="cpu_seconds")["packed"] == pytest.approx([3.0, 2.0])
    assert fmt_spread([2.2, 2.4]) == "2.300 (2.200–2.400)"
    assert fmt_spread([1.0]) == "1.000"
    assert fmt_spread([1.0, 2.0, 3.0], "{:.1f}") == "2.0 ± 1.0"
    table = summary_table(records)
    assert "2.50±0.50x" in table and "machine: x, 2 cores" in table
    assert "pairs again" in table and "50% (r 10%)" in table and "0.20% (r 10%)" in table


def test_gsm8k_answer_parsing():
    assert gsm8k_answer("so 3 + 4 = 7.\n#### 7") == "7"
    assert gsm8k_answer("#### 1,234") == "1234"
    assert gsm8k_answer("#### $5.00") == "5"
    assert gsm8k_answer("no answer") is None
    assert gsm8k_exact_match("blah #### 18", "x\n#### 18")
    assert not gsm8k_exact_match("blah", "#### 18")


def test_bench_records_and_draws_a_batch_schedule_and_backoff(tmp_path):
    """BenchConfig(batch_schedule=, oom_backoff=): every record holds the schedule its run realised (the
    step sizes follow it) and what the back-off did; the report draws the schedule."""
    train = write_gsm8k_like(tmp_path / "data")
    mp = pytest.MonkeyPatch()
    for key, value in MICRO.items():
        mp.setitem(bench_models.TINY_LLAMA, key, value)
    try:
        records = run_bench(
            train, model="tiny-llama", strategies=("token_budget",), num_examples=NUM_TRAIN, batch_size=4,
            eval_examples=4, num_generations=0, out_dir=tmp_path / "out", progress=False,
            batch_schedule="0:2 6:4", schedule_unit="examples", lr_scaling="sqrt",
            oom_backoff={"fail_over_tokens": 60},
        )  # fmt: skip
    finally:
        mp.undo()
    for r in records:
        assert r["status"] == "ok"
        sched = r["schedule"]
        assert sched["target"][:2] == [2, 2] and sched["target"][-1] == 4
        assert sched["size"][:3] == [2, 2, 2] and sum(sched["size"]) == NUM_TRAIN
        assert r["num_steps"] == len(sched["size"]) and len(r["loss_curve"]["examples"]) == r["num_steps"]
        assert r["loss_curve"]["examples"][-1] == NUM_TRAIN
        assert r["oom_backoff"]["num_failures"] >= 1 and r["fallbacks"].get("trainer.oom_backoff", 0) >= 1
    report = (tmp_path / "out" / "report.md").read_text()
    assert "schedule.png" in report and "back-off" in report
    assert list((tmp_path / "out").glob("*-schedule.png"))


def test_classification_path_skips_packed(tmp_path):
    folder = tmp_path / "sst"
    folder.mkdir()
    rows = ["label\tsentence"] + [
        f"{i % 2}\t{'great fun' if i % 2 else 'dull and slow'} film number {i}" for i in range(16)
    ]
    (folder / "train.tsv").write_text("\n".join(rows) + "\n")
    (folder / "dev.tsv").write_text("\n".join(rows[:7]) + "\n")
    records = run_bench(
        folder / "train.tsv", model="minilm", strategies=("random", "packed"), num_examples=8, batch_size=4,
        eval_examples=6, out_dir=tmp_path / "out", progress=False,
    )  # fmt: skip
    by = {r["strategy"]: r for r in records}
    assert by["packed"]["status"] == "skipped" and "classification" in by["packed"]["skip_reason"]
    ok = by["random"]
    assert ok["task"] == "classification" and ok["task_metric"]["name"] == "accuracy"
    assert ok["task_metric"]["total"] == 6 and ok["num_examples_seen"] == 8
    assert ok["data"]["eval_source"].endswith("dev.tsv")
    assert "skipped" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize("name", ["token_budget", "packed", "packed[window=64]", "token_budget[window=32]"])
def test_matched_budgets_hold_every_seed_to_the_fixed_step_count(name):
    """match_steps: the budget is the smallest at which no seed's plan takes more batches than fixed
    batches; a windowed plan's batch count depends on its seed, so matching one seed is not enough."""
    import numpy as np

    from smart_batching.bench.runner import matched_budgets
    from smart_batching.bench.training import strategy_options
    from smart_batching.planners import plan_batches, spec_class

    lengths = np.random.default_rng(3).lognormal(5.0, 0.6, size=240).astype(np.int64).clip(8, 900)
    seeds = range(5)
    budget = matched_budgets(lengths, [name], 16, 4096, 4096, seeds)[name]
    base, options = strategy_options(name, batch_size=16, max_tokens=4096, capacity=4096)
    option = spec_class(base).budget_option
    assert list(budget) == [option]

    def batches(value: int, seed: int) -> int:
        return len(plan_batches(lengths, base, seed=seed, **{**options, option: value}))

    target = 240 // 16
    assert all(batches(budget[option], s) <= target for s in seeds)
    assert any(batches(budget[option] - 1, s) > target for s in seeds)  # the smallest such budget
