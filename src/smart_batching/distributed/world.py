"""Topology: where this process sits, read from ``torch.distributed`` here and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass

from smart_batching.errors import ConfigError


@dataclass(frozen=True)
class World:
    """Where this process sits: ``rank`` in ``0..world_size-1``."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"World: world_size= must be ≥ 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"World: rank= must be in 0..{self.world_size - 1}, got {self.rank}")

    @classmethod
    def detect(cls) -> World:
        """The one place topology is read: ``torch.distributed`` if initialised, else the launcher's
        ``RANK``/``WORLD_SIZE`` environment, else a single process."""
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return cls(dist.get_rank(), dist.get_world_size())
        except ImportError:  # pragma: no cover - torch is an optional dependency here
            pass
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


def shutdown() -> None:
    """Destroy the default ``torch.distributed`` process group, if one is up; call it at the end of a
    multi-process script, after the last collective and after dropping the DDP/FSDP model (or trainer).

    A gloo process group left to interpreter exit can abort the process (``terminate called without an
    active exception``, SIGABRT; pytorch/pytorch#190489): its worker threads still hold tensors when
    Python tears down. A DDP model keeps the group alive through its reducer, so it must go first;
    garbage is collected here so that dropped models are really gone.
    """
    import gc

    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is an optional dependency here
        return
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["World", "shutdown"]
