"""The learning rate of steps whose size a batch schedule changes (lr_scaling)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from smart_batching import ConfigError  # noqa: E402
from smart_batching.adaptive.lr import check_lr_scaling, lr_factors, scale_lr_lambdas  # noqa: E402


def test_factors_follow_the_square_root_and_linear_rules():
    sizes = np.array([1000, 4000, 9000])
    np.testing.assert_allclose(lr_factors(sizes, "sqrt", 1000), [1.0, 2.0, 3.0])
    np.testing.assert_allclose(lr_factors(sizes, "linear", 1000), [1.0, 4.0, 9.0])
    np.testing.assert_allclose(lr_factors(sizes, None, 1000), [1.0, 1.0, 1.0])
    with pytest.raises(ConfigError, match="lr_scaling"):
        check_lr_scaling("cubic")


def test_olmo_core_rule_compounds_to_the_same_factor():
    """OLMo-core multiplies the base rate by sqrt(new / current) at each change; over a run of changes
    that is sqrt(size / first size), the factor lr_factors gives each step."""
    sizes = [256, 512, 1536, 3072]
    base, compounded = 1.0, []
    for prev, new in zip([sizes[0], *sizes], sizes, strict=False):
        base *= math.sqrt(new / prev)
        compounded.append(base)
    np.testing.assert_allclose(lr_factors(sizes, "sqrt", sizes[0]), compounded)


def test_scheduler_lambdas_are_scaled_once_per_step():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = transformers.get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=10)
    plain = [transformers.get_scheduler("linear", torch.optim.SGD([param], lr=0.1), num_warmup_steps=2,
                                        num_training_steps=10).lr_lambdas[0](s) for s in range(10)]  # fmt: skip
    factors = lr_factors(np.arange(1, 11) * 100, "sqrt", 100)
    scale_lr_lambdas(sched, lambda s: float(factors[min(s, 9)]))
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    np.testing.assert_allclose(seen, 0.1 * np.asarray(plain) * factors, rtol=1e-12)
    assert sched.get_last_lr()[0] == opt.param_groups[0]["lr"]
    assert "lr_lambdas" in sched.state_dict()  # the state dict still saves


def test_schedulers_that_are_not_functions_of_the_step_are_refused():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError, match="reduce_lr_on_plateau"):
        scale_lr_lambdas(torch.optim.lr_scheduler.ReduceLROnPlateau(opt), lambda s: 1.0)
