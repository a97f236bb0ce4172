"""``python -m smart_batching COMMAND ...``: the same as the ``smart-batching`` console script."""

from smart_batching.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
