"""``group_by_length`` against transformers' ``LengthGroupedSampler``.

With ``generator="torch"`` the megabatch permutation is drawn as ``get_length_grouped_indices`` draws
it, so for the same lengths, batch size and seed the order is the very list the sampler yields, pass
after pass (our epoch ``e`` is the sampler's ``e + 1``-th pass over one generator). Cases ported from
transformers ``tests/trainer/test_trainer_utils.py::TrainerUtilsTest::test_group_by_length``, plus
ties, sizes that do not divide, explicit ``mega_batch_mult`` and several epochs.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.trainer_pt_utils import LengthGroupedSampler  # noqa: E402

from smart_batching.planners import plan_batches  # noqa: E402

MOVED = "transformers' LengthGroupedSampler order moved (get_length_grouped_indices changed)"


def hf_orders(lengths, batch_size: int, seed: int, epochs: int, mega_batch_mult=None) -> list[list[int]]:
    sampler = LengthGroupedSampler(
        batch_size, lengths=list(map(int, lengths)), generator=torch.Generator().manual_seed(seed)
    )
    if mega_batch_mult is not None:  # the sampler passes no mult: call the function it calls
        from transformers.trainer_pt_utils import get_length_grouped_indices

        gen = torch.Generator().manual_seed(seed)
        return [
            get_length_grouped_indices(list(map(int, lengths)), batch_size, mega_batch_mult, generator=gen)
            for _ in range(epochs)
        ]
    return [list(sampler) for _ in range(epochs)]


def ours(lengths, batch_size: int, seed: int, epoch: int, mega_batch_mult=None) -> list[int]:
    plan = plan_batches(
        np.asarray(lengths), "group_by_length", batch_size=batch_size, mode="megabatch", generator="torch",
        megabatch_mult=mega_batch_mult, seed=seed, epoch=epoch,
    )  # fmt: skip
    return plan.example_ids.tolist()


def test_ported_biggest_first_and_a_permutation():
    """transformers test_group_by_length: 100 lengths in [0, 25), one of 50 at index 32."""
    lengths = torch.randint(0, 25, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    lengths = [max(n, 1) for n in lengths]  # empty examples are left out of our plans (units)
    lengths[32] = 50
    order = ours(lengths, 4, seed=0, epoch=0)
    assert lengths[order[0]] == 50
    assert sorted(order) == list(range(100))
    assert order == hf_orders(lengths, 4, seed=0, epochs=1)[0], MOVED


@pytest.mark.parametrize(
    ("n", "batch_size", "seed", "top"),
    [(100, 4, 0, 25), (37, 5, 1, 50), (1000, 8, 3, 50), (500, 16, 7, 400), (3, 8, 2, 5), (64, 4, 9, 2)],
)
def test_same_order_as_length_grouped_sampler_for_three_epochs(n, batch_size, seed, top):
    lengths = np.random.default_rng(seed).integers(1, top, size=n)  # many ties when top is small
    expected = hf_orders(lengths, batch_size, seed, epochs=3)
    for epoch in range(3):
        assert ours(lengths, batch_size, seed, epoch) == expected[epoch], f"{MOVED} (epoch {epoch})"


@pytest.mark.parametrize("mult", [1, 3, 50])
def test_same_order_with_an_explicit_mega_batch_mult(mult):
    lengths = np.random.default_rng(5).integers(1, 30, size=211)
    expected = hf_orders(lengths, 4, seed=11, epochs=2, mega_batch_mult=mult)
    assert [ours(lengths, 4, 11, e, mult) for e in range(2)] == expected, MOVED


def test_numpy_generator_keeps_hf_semantics_not_its_indices():
    """The default draws its own permutation: same rule (longest first, megabatches sorted), other order."""
    lengths = np.random.default_rng(0).integers(1, 25, size=100)
    lengths[32] = 50
    plan = plan_batches(lengths, "group_by_length", batch_size=4, mode="megabatch", seed=0)
    assert lengths[plan.example_ids[0]] == 50
    assert plan.example_ids.tolist() != hf_orders(lengths, 4, 0, 1)[0]
