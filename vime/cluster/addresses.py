"""Which address this node's listeners bind to, and which ports they take.

    python -m vime.cluster.addresses [--interface IF]     # print this node's address

Order: an explicit address (`cluster.node_address`), else $VIME_HOST_IP, else the IPv4 address of
`cluster.interface`, else the NodeAddr Slurm has for this node ($SLURMD_NODENAME), else 127.0.0.1
(one host). The Slurm job exports VIME_HOST_IP on every node, so all of a job's processes agree.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess

from vime.utils.net import is_loopback

HOST_IP_ENV = "VIME_HOST_IP"
LOOPBACK = "127.0.0.1"


def interface_address(interface: str) -> str:
    """The first IPv4 address of `interface`; ValueError naming the interfaces there are."""
    import psutil

    addresses = psutil.net_if_addrs()
    if interface not in addresses:
        raise ValueError(
            f"cluster.interface={interface!r}: no such interface on {socket.gethostname()}; "
            f"this node has {sorted(addresses)}"
        )
    for entry in addresses[interface]:
        if entry.family == socket.AF_INET:
            return entry.address
    raise ValueError(f"cluster.interface={interface!r} has no IPv4 address")


def slurm_node_address() -> str | None:
    """Slurm's NodeAddr for this node (resolved to an IPv4 address), or None outside a job."""
    node = os.environ.get("SLURMD_NODENAME")
    if not node:
        return None
    try:
        shown = subprocess.run(
            ["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    for field in shown.stdout.split():
        if field.startswith("NodeAddr="):
            name = field.split("=", 1)[1]
            try:
                return socket.gethostbyname(name)
            except OSError as exc:
                raise ValueError(
                    f"Slurm's NodeAddr {name!r} of node {node} does not resolve ({exc}): set "
                    "cluster.interface (or VIME_HOST_IP) to pick the node's address"
                ) from None
    return None


def node_address(explicit: str | None = None, interface: str | None = None) -> str:
    """This node's address, in the order of the module docstring.

    Inside a Ray worker (an engine actor) with no address given, it is the address the node's
    raylet was started with, which the Slurm job sets to the node address.
    """
    if explicit:
        return explicit
    if os.environ.get(HOST_IP_ENV):
        return os.environ[HOST_IP_ENV]
    if interface:
        return interface_address(interface)
    slurm_address = slurm_node_address()
    if slurm_address:
        return slurm_address
    ray_address = _ray_node_address()
    return ray_address or LOOPBACK


def _ray_node_address() -> str | None:
    import sys

    if "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    return ray.util.get_node_ip_address()


def check_reachable(address: str, field: str, *, own_host: str, peer_hosts: list[str]) -> None:
    """A loopback `address` reaches only processes on the same machine: ValueError otherwise.

    `own_host`: the hostname of the machine that listens; `peer_hosts`: the machines that must
    connect (e.g. the engines' nodes). One machine can hold several test nodes, each with its own
    127.x address; different machines cannot reach each other's loopback.
    """
    if not is_loopback(address):
        return
    others = sorted({host for host in peer_hosts if host != own_host})
    if others:
        raise ValueError(
            f"{field}={address} is a loopback address, but processes on {others} must reach it "
            f"from other machines than {own_host!r}: set cluster.interface (or {HOST_IP_ENV}) to "
            "an address those nodes can reach"
        )


def check_engines_reachable(
    urls: list[str],
    machines: list[str],
    *,
    rendezvous: str | None,
    rendezvous_field: str | None = None,
) -> None:
    """Every rank: each engine's URL can be reached from this machine, and (broadcast
    transports) the engine machines can reach this node's `rendezvous` address; ValueError
    naming the field to change otherwise."""
    import socket
    from urllib.parse import urlsplit

    hostname = socket.gethostname()
    for url, machine in zip(urls, machines, strict=True):
        check_reachable(
            urlsplit(url).hostname or "", "engine.host", own_host=machine, peer_hosts=[hostname]
        )
    if rendezvous is not None:
        field = rendezvous_field or (
            "the node address (cluster.node_address / VIME_HOST_IP / cluster.interface)"
        )
        check_reachable(rendezvous, field, own_host=hostname, peer_hosts=machines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print this node's address (see module doc).")
    parser.add_argument("--interface", default=None, help="take this interface's IPv4 address")
    args = parser.parse_args(argv)
    print(node_address(interface=args.interface or None))


if __name__ == "__main__":
    main()
