"""Ports and addresses: free ports on a given address, loopback checks. Imports nothing of vime."""

from __future__ import annotations

import contextlib
import ipaddress
import random
import socket
from collections.abc import Iterable
from pathlib import Path

# Linux's default when /proc does not say; the kernel hands these to every bind(port 0).
DEFAULT_EPHEMERAL_PORTS = (32768, 60999)
# Ports chosen here for a later bind: above Ray's worker ports (10002-19999), below the ephemeral
# range. A port inside the ephemeral range can be handed to another process's bind(0) (Ray's
# agents, vLLM's ZMQ sockets, torch's stores) between this choice and the bind that follows.
LISTEN_PORTS = (20000, 32767)
# A system-seeded generator: two processes whose `random` a test seeded alike must not probe the
# same sequence of ports.
_pick = random.SystemRandom()


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for bind(port 0) (net.ipv4.ip_local_port_range)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_PORTS


def _listen_candidates() -> list[int]:
    """LISTEN_PORTS outside the ephemeral range, in random order (so that concurrent choosers
    rarely probe the same port first)."""
    low, high = ephemeral_port_range()
    ports = [p for p in range(LISTEN_PORTS[0], LISTEN_PORTS[1] + 1) if not low <= p <= high]
    _pick.shuffle(ports)
    return ports


def _bind_free(address: str, candidates: Iterable[int], stack: contextlib.ExitStack) -> int | None:
    """Bind the first candidate nothing holds at `address`, keep it bound on `stack`, return it."""
    for port in candidates:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((address, port))
        except OSError:
            sock.close()
            continue
        stack.callback(sock.close)
        return sock.getsockname()[1]
    return None


def free_ports(
    address: str = "127.0.0.1", count: int = 1, port_range: tuple[int, int] | None = None
) -> list[int]:
    """`count` distinct ports nothing listens on at `address`, for a bind that comes later (in
    another process, as a rule): from `port_range` (inclusive, lowest first), else from
    LISTEN_PORTS outside the kernel's ephemeral range, else (no such port) any the kernel gives.
    All are held bound until all are chosen, so no two are the same. Free when this returns."""
    if port_range is not None:
        candidates = list(range(port_range[0], port_range[1] + 1))
        fallback: list[int] = []
        searched = f"{port_range[0]}-{port_range[1]}"
    else:
        candidates, fallback = _listen_candidates(), [0]
        searched = f"{LISTEN_PORTS[0]}-{LISTEN_PORTS[1]} nor any the kernel gives"
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            port = _bind_free(address, candidates, stack) or _bind_free(address, fallback, stack)
            if port is None:
                raise RuntimeError(
                    f"no free port at {address} in {searched}: widen the range or stop what "
                    f"holds those ports (or is {address} an address of this host?)"
                )
            ports.append(port)
        return ports


def free_port(address: str = "127.0.0.1", port_range: tuple[int, int] | None = None) -> int:
    """One port nothing listens on at `address` (see free_ports). Free when this returns; bind
    it soon."""
    return free_ports(address, 1, port_range)[0]


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable only from the same machine."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
