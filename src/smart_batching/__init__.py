"""smart-batching: plan padding-free batches for fine-tuning and batched inference.

The top level is light: numpy and the planners only. transformers, datasets and matplotlib are imported
by the modules that need them, when they are used.
"""

from __future__ import annotations

from smart_batching.errors import ConfigError, DataError, OverlongError, SmartBatchingError
from smart_batching.plan import BatchPlan, PlanStats, packing_lower_bound
from smart_batching.planners import (
    STRATEGIES,
    GroupByLengthSpec,
    MaxLengthSpec,
    PackedSpec,
    RandomSpec,
    TokenBudgetSpec,
    make_spec,
    plan_batches,
)

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "BatchPlan",
    "ConfigError",
    "DataError",
    "GroupByLengthSpec",
    "MaxLengthSpec",
    "OverlongError",
    "PackedSpec",
    "PlanStats",
    "RandomSpec",
    "SmartBatchingError",
    "TokenBudgetSpec",
    "__version__",
    "make_spec",
    "packing_lower_bound",
    "plan_batches",
]
