"""`import smart_batching` stays light: no transformers, datasets, matplotlib (or torch) at import."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("transformers", "datasets", "matplotlib", "torch", "accelerate", "trl")


def test_top_level_import_is_light() -> None:
    code = (
        "import sys, smart_batching, smart_batching.planners, smart_batching.plan, smart_batching.distributed,"
        " smart_batching.models, smart_batching.adaptive;"
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_public_surface() -> None:
    import smart_batching as sb

    for name in ("plan_batches", "BatchPlan", "PlanStats", "PackedSpec", "TokenBudgetSpec", "STRATEGIES"):
        assert hasattr(sb, name), name
    # The built-in strategies, each a registered name that makes its spec; the named defaults among them.
    assert len(sb.STRATEGIES) >= 5 and sb.planners.strategy_names()[: len(sb.STRATEGIES)] == sb.STRATEGIES
    assert all(sb.make_spec(name).name == name for name in sb.STRATEGIES)
    planners = sb.planners
    assert {planners.DEFAULT_STRATEGY, planners.BASELINE_STRATEGY, planners.FASTEST_STRATEGY} <= set(
        sb.STRATEGIES
    )


def test_package_root_holds_at_most_ten_modules() -> None:
    """Subsystems live in packages; the root keeps the values, errors and the few cross-cutting modules
    (docs/layout.md). ``__init__`` and ``__main__`` are the package itself, not modules of it."""
    from pathlib import Path

    import smart_batching

    root = Path(smart_batching.__file__).parent
    modules = sorted(p.name for p in root.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= 10, f"{len(modules)} modules at the package root: {modules}"
