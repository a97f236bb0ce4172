"""Token lengths of the shared data sets, for a GPU machine that has neither ``../shared`` nor tokenizers.

Writes ``<name>_lengths.npy`` and ``<name>_prompt_lengths.npy`` (int32, one entry per training record)
for GSM8K, LIMA and SGD (or the names given after the folder; ``default`` is the library's embedded
data set, which needs no ``../shared``: the dry run's lengths where no bundle was made) into the folder
given, tokenised as ``smart-batching train`` does: read by
:func:`smart_batching.data.load_dataset_any`, rendered by :mod:`smart_batching.data.formats` and
tokenised with SmolLM2 (full text plus EOS; the prompt's tokens are the part without loss). Run by
``make device-bundle`` (``scripts/device_bundle.sh``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from smart_batching.data import load_dataset_any
from smart_batching.data.default_data import default_dataset_as_hf
from smart_batching.data.formats import detect_format
from smart_batching.data.tasks import _tokenize_causal
from smart_batching.data.tokenizers import load_tokenizer

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DATASETS = {
    "gsm8k": "gsm8k/train.jsonl",
    "lima": "lima/lima.json",
    "sgd": "sgd_dialogues/train.jsonl.gz",
}


def main(out: str, names: list[str] | None = None) -> int:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer("smollm2")
    info = {}
    for name in names or list(DATASETS):
        t0 = time.perf_counter()
        rel = DATASETS.get(name, name)
        ds = default_dataset_as_hf() if name == "default" else load_dataset_any(str(SHARED / rel))
        columns, _ = _tokenize_causal(ds, tokenizer, detect_format(list(ds.column_names)), None)
        lengths = np.array([len(x) for x in columns["input_ids"]], dtype=np.int32)
        prompts = np.array(columns["prompt_length"], dtype=np.int32)
        np.save(out_dir / f"{name}_lengths.npy", lengths)
        np.save(out_dir / f"{name}_prompt_lengths.npy", prompts)
        info[name] = {
            "source": rel,
            "tokenizer": "smollm2",
            "num_examples": int(lengths.size),
            "mean_length": float(lengths.mean()),
            "p50_length": float(np.median(lengths)),
            "max_length": int(lengths.max()),
        }
        print(f"{name}: {info[name]} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    (out_dir / "lengths.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".device-bundle/lengths", sys.argv[2:]))
