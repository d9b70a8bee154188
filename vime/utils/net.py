"""Ports and addresses: free ports on a given address, loopback checks. Imports nothing of vime."""

from __future__ import annotations

import contextlib
import ipaddress
import socket


def free_port(address: str = "127.0.0.1", port_range: tuple[int, int] | None = None) -> int:
    """A port nothing listens on at `address`: the first free one in `port_range` (inclusive),
    or any free one. It is free when this returns; bind it soon."""
    candidates = range(port_range[0], port_range[1] + 1) if port_range else [0]
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError(
        f"no free port at {address} in {candidates[0]}-{candidates[-1]}: widen the range or stop "
        "what holds those ports"
    )


def free_ports(address: str, count: int) -> list[int]:
    """`count` distinct ports nothing listens on at `address` (all held bound until chosen, so
    no two are the same). Free when this returns; bind them soon."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((address, 0))
            ports.append(sock.getsockname()[1])
        return ports


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable only from the same machine."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
