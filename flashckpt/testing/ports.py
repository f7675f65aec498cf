"""Ports from the OS for the servers tests start (etcd members, the S3 server)."""

from __future__ import annotations

import socket
from contextlib import ExitStack

__all__ = ["free_ports"]


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports the OS reports free (held together while chosen)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports
