"""Golden plan hashes: the same lengths, strategy, options, seed and epoch give the same plan, bit for
bit, as when these hashes were taken (2026-11-25, before the strategy-knowledge refactor of issue 18).

A refactor that must not change behaviour keeps every hash. A change that is meant to alter plans
(a new algorithm, a fixed bug) updates the hashes it changes in the same commit and says why; run
``python tests/test_golden_plans.py`` to print the current table. Covered: every strategy's plan for
three (seed, epoch) pairs, ``distribute()`` at 2 ranks x 1 micro-batch and 4 x 2, and the streaming
planner over a bounded buffer.

Changed on purpose (issue 17, the costliest step first): ``token_budget`` and ``packed`` plans (their
costliest batch is swapped to the front; with ``costliest_first=False`` they are the earlier plans, kept
in :data:`GOLDEN_COSTLIEST_OFF`), the streaming plans of both (first round), and ``distribute()`` for
``group_by_length``, ``token_budget`` and ``packed`` (the step holding the costliest micro-batch first).
``group_by_length``'s single-process and streaming plans kept their hashes: megabatch mode already put
the longest example first.

Changed on purpose (issue 23, distributed planning at any length distribution): ``distribute()`` of
``token_budget`` at 2 x 1 (``long``) and 4 x 2 (both). Their one uneven step is now formed again with
donor steps by the compiled mixer (``distributed/_mix.py``) before the Python re-forming: every example
once, the same step count, within the limits (max step imbalance ``sft`` 4 x 2: 1.0044 -> 1.0032;
``long`` 2 x 1: 1.0084 -> 1.0093, 4 x 2: 1.0104 -> 1.0080).

Changed on purpose (issue 13, defaults that keep accuracy): ``group_by_length``'s default mode is
``"sorted"``. The megabatch cases above now name ``mode="megabatch"`` and keep their hashes (HF's
semantics); the default's plans are in :data:`GOLDEN_DEFAULT`.

Changed on purpose (issue 34, same model sooner): ``packed``'s default algorithm is ``"spread_fit"``
(rows of mixed lengths). The cases above now name ``algorithm="auto"`` and keep their hashes; the
default's plans are in :data:`GOLDEN_DEFAULT`.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from smart_batching import plan_batches
from smart_batching.distributed import distribute

CASES = [
    ("sft", "random", {"batch_size": 16}),
    ("sft", "max_length", {"batch_size": 16, "max_length": 1000}),
    ("sft", "group_by_length", {"batch_size": 16, "mode": "megabatch"}),
    ("sft", "token_budget", {"max_tokens": 4096}),
    ("sft", "packed", {"capacity": 2048, "algorithm": "auto"}),
    ("long", "group_by_length", {"batch_size": 8, "mode": "megabatch"}),
    ("long", "token_budget", {"max_tokens": 16384}),
    ("long", "packed", {"capacity": 8192, "algorithm": "auto"}),
]
GOLDEN = {
    "sft/random/0/0": "4ef76fce808487c3",
    "sft/random/0/1": "5fa6fc2e6a0d8e3f",
    "sft/random/7/0": "723b871bdcd5ccc5",
    "sft/random/distribute/2x1": "477d9adfb665d7a2",
    "sft/random/distribute/4x2": "b57ddfa0e0f68f08",
    "sft/random/stream": "2b1b0d14775fbacf",
    "sft/max_length/0/0": "34d22a101a96a949",
    "sft/max_length/0/1": "3a5396ba843e390d",
    "sft/max_length/7/0": "fc02e45195f5e4ab",
    "sft/max_length/distribute/2x1": "477d9adfb665d7a2",
    "sft/max_length/distribute/4x2": "b57ddfa0e0f68f08",
    "sft/max_length/stream": "2b1b0d14775fbacf",
    "sft/group_by_length/0/0": "f8d03c6105e4a93f",
    "sft/group_by_length/0/1": "25c8b7c21345253d",
    "sft/group_by_length/7/0": "bafa4e89cca85440",
    "sft/group_by_length/distribute/2x1": "d6647afe88d114d6",
    "sft/group_by_length/distribute/4x2": "36299bbbe0067099",
    "sft/group_by_length/stream": "8709ac8a0b648709",
    "sft/token_budget/0/0": "8e60f9812b01ceff",
    "sft/token_budget/0/1": "dd787298f520fa10",
    "sft/token_budget/7/0": "620a7e61c34b33dd",
    "sft/token_budget/distribute/2x1": "abb39098695ceb6b",
    "sft/token_budget/distribute/4x2": "86a12afed493ef4e",
    "sft/token_budget/stream": "15653cffd0db2649",
    "sft/packed/0/0": "d06a291ff9240b32",
    "sft/packed/0/1": "d452c1471daca750",
    "sft/packed/7/0": "e58f5894e213644f",
    "sft/packed/distribute/2x1": "8124f1bf5d3f0a9b",
    "sft/packed/distribute/4x2": "f04b25cdf2d5ceac",
    "sft/packed/stream": "dd433c29555cc65d",
    "long/group_by_length/0/0": "c058c5745b05e6ce",
    "long/group_by_length/0/1": "e645b3876c4d6fd4",
    "long/group_by_length/7/0": "7d0034f61daddabf",
    "long/group_by_length/distribute/2x1": "2014602c8e8153e1",
    "long/group_by_length/distribute/4x2": "1069b8b529a771cd",
    "long/group_by_length/stream": "160f360e97db60ec",
    "long/token_budget/0/0": "54c6217441060dc5",
    "long/token_budget/0/1": "635c16fcfb88ce4e",
    "long/token_budget/7/0": "6815b61f3c752692",
    "long/token_budget/distribute/2x1": "4b8d1b66d5fcac9d",
    "long/token_budget/distribute/4x2": "caa84b1c003227ca",
    "long/token_budget/stream": "050a55fcacd260fb",
    "long/packed/0/0": "dd41f39b848ba8f6",
    "long/packed/0/1": "84d29fc42bd93e16",
    "long/packed/7/0": "0565dc51836ad164",
    "long/packed/distribute/2x1": "6b2f06b75ccff6cd",
    "long/packed/distribute/4x2": "48a1cd6a5cb4027c",
    "long/packed/stream": "ef116355c4f87012",
}

# token_budget and packed with costliest_first=False: the plans from before the costliest batch went first
# (issue 17), bit for bit.
GOLDEN_COSTLIEST_OFF = {
    "sft/token_budget/0/0": "b55296f9167e5970",
    "sft/token_budget/0/1": "541fd2ff777c02bd",
    "sft/token_budget/7/0": "77ff152d8bc3a547",
    "sft/token_budget/distribute/2x1": "1158b5101b8ff5fa",
    "sft/token_budget/distribute/4x2": "73d190338ab39f2e",
    "sft/token_budget/stream": "bf70ae0da7c1b5d3",
    "sft/packed/0/0": "86efc9daa23943be",
    "sft/packed/0/1": "0776d4bcff018072",
    "sft/packed/7/0": "7cbaae12edc002c4",
    "sft/packed/distribute/2x1": "830c79e08cdec336",
    "sft/packed/distribute/4x2": "0f7c392b448f7f37",
    "sft/packed/stream": "8104e1ea248fc4a4",
    "long/token_budget/0/0": "dbaf934e9cbc70ec",
    "long/token_budget/0/1": "13c18bfe821f72fe",
    "long/token_budget/7/0": "d9accbee3cd13b77",
    "long/token_budget/distribute/2x1": "df026320349d11ca",
    "long/token_budget/distribute/4x2": "c75eaea8d0708517",
    "long/token_budget/stream": "bebbab6712d95486",
    "long/packed/0/0": "e6c6bc84eb524689",
    "long/packed/0/1": "00b05ba131634b2a",
    "long/packed/7/0": "52ef94c3a0e0a1a3",
    "long/packed/distribute/2x1": "7e9b870678132cec",
    "long/packed/distribute/4x2": "2a78b8c86a9767d0",
    "long/packed/stream": "bed279f7cf6a02c0",
}


# The defaults of strategies whose default changed after the hashes above were taken.
DEFAULT_CASES = [
    ("sft", "group_by_length", {"batch_size": 16}),
    ("long", "group_by_length", {"batch_size": 8}),
    ("sft", "packed", {"capacity": 2048}),
    ("long", "packed", {"capacity": 8192}),
]
GOLDEN_DEFAULT = {
    "sft/group_by_length/0/0": "9dacc86cf321b002",
    "sft/group_by_length/0/1": "1fe530d2ecadcd24",
    "sft/group_by_length/7/0": "8a317e3c4a21715c",
    "sft/group_by_length/distribute/2x1": "a3ec9e00ef8a45d5",
    "sft/group_by_length/distribute/4x2": "a3e55ed2abe26939",
    "sft/group_by_length/stream": "e7e10dd184790247",
    "long/group_by_length/0/0": "c598efefb43076fb",
    "long/group_by_length/0/1": "74ec942e0e9a149e",
    "long/group_by_length/7/0": "441d607ece4853e9",
    "long/group_by_length/distribute/2x1": "f7f3cd2f87a6fc02",
    "long/group_by_length/distribute/4x2": "6802dd472b86c3b0",
    "long/group_by_length/stream": "d855e7a0feb25b1a",
    "sft/packed/0/0": "8bccf19d95efe1d0",
    "sft/packed/0/1": "fbab9b2e5933d66a",
    "sft/packed/7/0": "551d10ea1c681db4",
    "sft/packed/distribute/2x1": "0725096c8c042421",
    "sft/packed/distribute/4x2": "79d78a4879353f23",
    "sft/packed/stream": "213793afa3dff4e4",
    "long/packed/0/0": "152ac19444f414cf",
    "long/packed/0/1": "2900aadf254f8864",
    "long/packed/7/0": "b6fe02707d55abb1",
    "long/packed/distribute/2x1": "d55b148a3440f85d",
    "long/packed/distribute/4x2": "c3b6e6ee3e6aebcd",
    "long/packed/stream": "e7d9887770e44f9b",
}


def _lengths(data: str) -> np.ndarray:
    # SFT-like (median 180 tokens) and long-context-like (median 900, heavy tail) lognormal lengths.
    n, seed, median, sigma, cap = {"sft": (3000, 1, 180, 0.5, 1000), "long": (800, 2, 900, 1.0, 8000)}[data]
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), sigma, n), 1, cap).astype(np.int64)


def _hash(*arrays: np.ndarray) -> str:
    m = hashlib.sha256()
    for a in arrays:
        m.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        m.update(b"|")
    return m.hexdigest()[:16]


def current(data: str, name: str, options: dict) -> dict[str, str]:
    """Every hash of one case, keyed as in :data:`GOLDEN`."""
    from smart_batching.streaming import StreamingBatcher

    lengths = _lengths(data)
    out = {}
    for seed, epoch in ((0, 0), (0, 1), (7, 0)):
        p = plan_batches(lengths, name, seed=seed, epoch=epoch, **options)
        out[f"{data}/{name}/{seed}/{epoch}"] = _hash(
            p.example_ids, p.seg_starts, p.seg_lengths, p.row_offsets, p.batch_offsets, p.batch_width
        )
    p = plan_batches(lengths, name, seed=0, epoch=0, **options)
    for world_size, accum in ((2, 1), (4, 2)):
        d = distribute(p, world_size, accum_steps=accum, seed=0)
        out[f"{data}/{name}/distribute/{world_size}x{accum}"] = _hash(
            d.segment_order, d.micro_batch_start, d.micro_batch_end, d.assignment
        )
    batches = StreamingBatcher(lengths.tolist(), name, buffer_size=500, seed=3, **options)
    text = json.dumps([[repr(s) for s in batch] for batch in batches])
    out[f"{data}/{name}/stream"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def _want(golden: dict[str, str], data: str, name: str) -> dict[str, str]:
    return {k: v for k, v in golden.items() if k.startswith(f"{data}/{name}/")}


# Each case with the table that holds its hashes (the defaults that changed: GOLDEN_DEFAULT).
TABLES = [(*case, "GOLDEN") for case in CASES] + [(*case, "GOLDEN_DEFAULT") for case in DEFAULT_CASES]


@pytest.mark.parametrize(
    ("data", "name", "options", "table"),
    TABLES,
    ids=[f"{d}-{n}" + ("-default" if t == "GOLDEN_DEFAULT" else "") for d, n, _, t in TABLES],
)
def test_plans_are_unchanged(data, name, options, table):
    golden = {"GOLDEN": GOLDEN, "GOLDEN_DEFAULT": GOLDEN_DEFAULT}[table]
    got = current(data, name, options)
    assert got == _want(golden, data, name), (
        f"plans changed: update {table} only if the change is meant (see the module docstring)"
    )


OFF_CASES = [case for case in CASES if case[1] in ("token_budget", "packed")]


@pytest.mark.parametrize(("data", "name", "options"), OFF_CASES, ids=[f"{d}-{n}" for d, n, _ in OFF_CASES])
def test_costliest_first_off_keeps_the_earlier_plans(data, name, options):
    got = current(data, name, {**options, "costliest_first": False})
    assert got == _want(GOLDEN_COSTLIEST_OFF, data, name)


if __name__ == "__main__":
    for cases in (CASES, DEFAULT_CASES):
        for case in cases:
            for key, value in current(*case).items():
                print(f'    "{key}": "{value}",')
        print()
