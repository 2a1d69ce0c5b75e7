"""Where a process group meets: a ``tcp://host:port`` on a port of this node free right now.

Imports no torch: Ray runs ``free_tcp_address`` as a zero-CPU task pinned to a node
(``runtime/placement.py``: the broadcast weight transfer's rendezvous), and its fresh worker
would otherwise import torch first (≈ 3 CPU-s on the path of every broadcast run's start). Not
here: the process groups themselves (``data_parallel.py``, ``weights/broadcast.py``).
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_tcp_address(host: str = LOOPBACK) -> str:
    """A ``tcp://host:port`` rendezvous on a port of this node free right now. ``host``: the
    address this node is reached at by the other ranks (on Ray, the node's IP as Ray knows it,
    never a guess from the hostname); the loopback when they all run on this node."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"
