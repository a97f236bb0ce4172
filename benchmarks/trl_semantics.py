"""What reaches the model under TRL's ``SFTTrainer`` alone and with ``apply_smart_batching``: documents
(attention segments), target tokens, and what happens to empty examples (issue 17's table).

One epoch of train batches is read from each trainer's DataLoader (no training) on a prompt/completion
copy task of 24 examples (the word-level tokenizer and tiny Llama of ``examples/trl_sft.py``). Target
tokens leave out each document's first label, which a causal LM never predicts.

Run::

    python benchmarks/trl_semantics.py            # a table
    python benchmarks/trl_semantics.py --json     # one JSON line per (case, method)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("trl_sft_example", ROOT / "examples" / "trl_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _segments_and_targets(batches: list[dict[str, Any]]) -> tuple[int, int]:
    segments = targets = 0
    for b in batches:
        labels = b["labels"]
        if "cu_seq_lens_q" in b:
            segments += int(b["cu_seq_lens_q"].numel() - 1)
            targets += int(((labels != -100) & (b["position_ids"] != 0)).sum())
        else:
            segments += int(labels.shape[0])
            targets += int((labels[:, 1:] != -100).sum())
    return segments, targets


def run_case(
    ex: Any, case: str, data: Any, config: dict[str, Any], strategy: str | None, options: dict
) -> dict:
    from trl import SFTConfig, SFTTrainer

    from smart_batching.hf import apply_smart_batching

    tok = ex.word_tokenizer()
    base = dict(
        output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, max_steps=1, per_device_train_batch_size=8,
        disable_tqdm=True, max_length=256, seed=0,
    )  # fmt: skip
    record: dict[str, Any] = {"case": case, "strategy": "trl" if strategy is None else f"sft+{strategy}"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer = SFTTrainer(
                model=ex.tiny_llama(len(tok)), args=SFTConfig(**{**base, **config}), train_dataset=data,
                processing_class=tok,
            )  # fmt: skip
            if strategy is not None:
                apply_smart_batching(trainer, strategy, **options)
            segments, targets = _segments_and_targets(list(trainer.get_train_dataloader()))
            record.update(documents=segments, target_tokens=targets, error=None)
        except Exception as exc:  # noqa: BLE001 - the table reports what a user would see
            record.update(documents=None, target_tokens=None, error=f"{type(exc).__name__}: {exc}"[:160])
    notes = [
        str(w.message) for w in caught if "empty example" in str(w.message) or "masked" in str(w.message)
    ]
    record["warning"] = notes[0][:160] if notes else None
    return record


def cases(ex: Any) -> list[tuple[str, Any, dict[str, Any], str, dict]]:
    import datasets

    data = ex.copy_task(24, seed=1)
    tok = ex.word_tokenizer()
    ids = [tok(p + c)["input_ids"] for p, c in zip(data["prompt"], data["completion"], strict=True)]
    ids[0] = ids[5] = []
    labels = [list(x) for x in ids]
    labels[7] = [-100] * len(labels[7])
    pre = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    return [
        ("packing=True", data, {"packing": True, "max_length": 128}, "packed", {}),
        ("completion_only_loss=False", data, {"completion_only_loss": False}, "packed", {}),
        (
            "completion_only_loss=False",
            data,
            {"completion_only_loss": False},
            "token_budget",
            {"max_tokens": 256},
        ),
        ("completion_only_loss default", data, {}, "packed", {}),
        ("2 empty + 1 fully masked, max_length=None", pre, {"max_length": None}, "packed", {"capacity": 256}),
    ]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON record per line")
    args = parser.parse_args(argv)
    ex = _example()
    records = []
    for case, data, config, strategy, options in cases(ex):
        if not any(r["case"] == case and r["strategy"] == "trl" for r in records):
            records.append(run_case(ex, case, data, config, None, {}))
        records.append(run_case(ex, case, data, config, strategy, options))
    if args.json:
        for r in records:
            print(json.dumps(r))
    else:
        print(f"{'case':<42} {'method':<17} {'documents':>9} {'targets':>7}  error / warning")
        for r in records:
            note = r["error"] or r["warning"] or ""
            docs = "-" if r["documents"] is None else r["documents"]
            targets = "-" if r["target_tokens"] is None else r["target_tokens"]
            print(f"{r['case']:<42} {r['strategy']:<17} {docs:>9} {targets:>7}  {note[:90]}")
    return records


if __name__ == "__main__":
    main()
