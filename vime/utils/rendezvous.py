"""Torch stores and gloo groups that listen on one given address, never on every interface.

`torch.distributed.TCPStore(is_master=True)` listens on all interfaces, and a gloo group binds its
pairs to the address `GLOO_SOCKET_IFNAME` or the hostname resolves to. A job's listeners must bind
to its node's address (see vime.cluster.addresses): this module builds both from a socket bound
there.

    store = listening_store("10.0.0.5", 0, world_size=3, timeout_s=600)   # port 0: any free one
    group = gloo_group(dist.PrefixStore("name", store), rank=0, world_size=3,
                       timeout_s=600, address="10.0.0.5")
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def listening_store(address: str, port: int, *, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The master TCPStore, listening on `address:port` only (port 0: a free one, see `.port`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(max(128, world_size))
        # The store takes the listening socket over (it closes the fd when it is destroyed).
        return dist.TCPStore(
            address,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.detach(),
        )
    except BaseException:
        sock.close()
        raise


def gloo_group(
    store: dist.Store, *, rank: int, world_size: int, timeout_s: float, address: str | None
) -> dist.ProcessGroupGloo:
    """A gloo group whose pairs listen on `address` (None: gloo's own choice of interface)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if address is None:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)
