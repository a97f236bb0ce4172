"""A free TCP port on the loopback interface, for the tests that start ``torch.distributed`` workers
(``mp.spawn`` with a ``tcp://`` init method, or ``torchrun --master_port``)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the OS has just handed out and released: free unless another process takes it first."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
