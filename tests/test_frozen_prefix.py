"""The held-out loss with the frozen prefix computed once (bench/frozen_prefix.py) equals the full
forward's, on a tiny Llama whose first layers are frozen, after optimizer steps on its last layers."""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from smart_batching import compat  # noqa: E402
from smart_batching.bench.evaluate import eval_causal_lm  # noqa: E402
from smart_batching.bench.frozen_prefix import FrozenPrefixCache  # noqa: E402
from smart_batching.fallbacks import FallbackWarning, recorded_fallbacks  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _llama(layers: int = 4, trainable: int = 2) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    compat.train_last_layers(model, trainable)
    return model


def _held_out(num: int = 7) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(num):
        n = int(torch.randint(6, 30, (1,), generator=g))
        rows.append(
            {"input_ids": torch.randint(1, 64, (n,), generator=g).tolist(), "prompt_length": 2 + i % 3}
        )
    return rows


def _train(model: torch.nn.Module, steps: int = 3) -> None:
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        ids = torch.randint(1, 64, (2, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def _loss(model, data, cache=None, batch_size=3):
    return eval_causal_lm(model, data, pad_token_id=0, batch_size=batch_size, prefix_cache=cache)["loss"]


def test_the_cached_prefix_gives_the_full_forwards_loss_after_training_the_last_layers():
    model, data, cache = _llama().eval(), _held_out(), FrozenPrefixCache()
    first = _loss(model, data, cache)  # fills the cache: 3 batches of up to 3 examples, padded
    assert first == _loss(model, data)
    assert (cache.num_filled, cache.num_reused, cache.start) == (3, 0, 2)
    _train(model)
    full = _loss(model, data)
    assert full != first  # the trained layers moved: the comparison below is not vacuous
    cached = _loss(model, data, cache)
    assert cache.num_reused == 3 and cache.num_filled == 3  # the prefix did not run again
    assert cached == pytest.approx(full, rel=1e-6, abs=0)
    # One batch holding every example (multi-example rows, padding inside): the same.
    whole = FrozenPrefixCache()
    _loss(model, data, whole, batch_size=len(data))
    _train(model, steps=2)
    assert _loss(model, data, whole, batch_size=len(data)) == pytest.approx(_loss(model, data), rel=1e-6)
    assert whole.num_reused == 1


def test_a_fresh_copy_reuses_the_prefix_and_changed_frozen_weights_refill_it():
    model, data, cache = _llama().eval(), _held_out(), FrozenPrefixCache()
    _loss(model, data, cache)
    copy_of = copy.deepcopy(model)  # another model with the same frozen weights (a run's fresh copy)
    _train(copy_of)
    assert _loss(copy_of, data, cache) == pytest.approx(_loss(copy_of, data), rel=1e-6)
    assert cache.num_reused == 3
    with torch.no_grad():
        copy_of.model.layers[0].mlp.up_proj.weight.mul_(1.5)  # a frozen layer changed in place
    assert _loss(copy_of, data, cache) == pytest.approx(_loss(copy_of, data), rel=1e-6)
    assert cache.num_filled == 6  # recomputed, not reused
    other = _held_out(5)  # other held-out tokens under the same batch numbers: recomputed
    assert _loss(copy_of, other, cache) == pytest.approx(_loss(copy_of, other), rel=1e-6)
    assert cache.num_filled == 8


def test_a_model_that_trains_everything_takes_the_full_forward_quietly():
    model, data, cache = _llama(trainable=4).eval(), _held_out(), FrozenPrefixCache()
    compat.train_last_layers(model, 4)
    for p in model.model.embed_tokens.parameters():
        p.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        assert _loss(model, data, cache) == _loss(model, data)
    assert cache.num_filled == cache.num_reused == 0


def test_an_unknown_structure_with_frozen_layers_takes_the_full_forward_with_a_warning():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=64)
    ).eval()
    model.transformer.h[0].requires_grad_(False)
    data, cache = _held_out(), FrozenPrefixCache()
    with pytest.warns(FallbackWarning, match="GPT2LMHeadModel"):
        loss = _loss(model, data, cache)
    assert loss == _loss(model, data)
    assert recorded_fallbacks().get("eval.frozen_prefix", 0) >= 1
    assert cache.num_filled == cache.num_reused == 0


def test_packed_held_out_rows_give_the_padded_loss_and_put_the_attention_back():
    model, data = _llama().eval(), _held_out()
    model.config.use_cache = True
    impl = model.config._attn_implementation
    padded = _loss(model, data)
    packed = eval_causal_lm(model, data, pad_token_id=0, batch_size=3, packed=True)
    assert packed["loss"] == pytest.approx(padded, rel=1e-5)
    assert packed["num_tokens"] == eval_causal_lm(model, data, pad_token_id=0, batch_size=3)["num_tokens"]
    assert (model.config._attn_implementation, model.config.use_cache) == (impl, True)
    # Packed rows (several examples each) with the cached prefix, after training the last layers.
    cache = FrozenPrefixCache()
    eval_causal_lm(model, data, pad_token_id=0, batch_size=3, packed=True, prefix_cache=cache)
    _train(model)
    full = eval_causal_lm(model, data, pad_token_id=0, batch_size=3, packed=True)["loss"]
    cached = eval_causal_lm(model, data, pad_token_id=0, batch_size=3, packed=True, prefix_cache=cache)[
        "loss"
    ]
    assert cache.num_reused == 3 and cached == pytest.approx(full, rel=1e-6)
    assert full == pytest.approx(_loss(model, data), rel=1e-5) and full != padded
    # The same batch numbers padded are other inputs: recomputed, not replayed from the packed rows.
    assert _loss(model, data, cache) == pytest.approx(_loss(model, data), rel=1e-6)
    assert cache.num_filled == 6


def test_a_copy_sent_to_another_process_starts_empty_and_works():
    """The bench context goes to torchrun ranks by pickle (``make demo``'s 2-process run): the cache's
    weak references to this process's models cannot travel, and its hidden states need not."""
    import pickle

    model, data, cache = _llama().eval(), _held_out(), FrozenPrefixCache()
    _loss(model, data, cache)
    assert cache.entries and cache.num_filled == 3
    sent = pickle.loads(pickle.dumps(cache))
    assert (sent.entries, sent.num_filled, sent.num_reused, sent.start) == ({}, 0, 0, None)
    assert _loss(model, data, sent) == _loss(model, data) and sent.num_filled == 3
    assert cache.num_filled == 3 and len(cache.entries) == 3  # the original keeps what it recorded
