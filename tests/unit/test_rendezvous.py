"""The weight-sync store and gloo groups listen on the node's address only, never on every
interface (two "nodes" of this machine: 127.0.0.2 and 127.0.0.3)."""

from __future__ import annotations

import os
import threading

import psutil
import pytest
import torch
import torch.distributed as dist

from vime.utils.rendezvous import gloo_group, listening_store

pytestmark = pytest.mark.unit


def _listening() -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(os.getpid()).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }


def test_store_and_gloo_pairs_listen_on_the_given_addresses_only():
    before = _listening()
    store = listening_store("127.0.0.2", 0, world_size=2, timeout_s=30)
    client = dist.TCPStore("127.0.0.2", store.port, 2, is_master=False)
    groups = {}

    def join(rank: int, address: str, rank_store) -> None:
        groups[rank] = gloo_group(
            dist.PrefixStore("test", rank_store),
            rank=rank,
            world_size=2,
            timeout_s=30,
            address=address,
        )

    threads = [
        threading.Thread(target=join, args=(0, "127.0.0.2", store)),
        threading.Thread(target=join, args=(1, "127.0.0.3", client)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert set(groups) == {0, 1}
    new = _listening() - before
    assert ("127.0.0.2", store.port) in new
    assert new and {ip for ip, _ in new} <= {"127.0.0.2", "127.0.0.3"}, new

    # The group works: rank 0 broadcasts, rank 1 receives.
    sent, received = torch.arange(8.0), torch.zeros(8)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    works = [groups[0].broadcast([sent], options), groups[1].broadcast([received], options)]
    for work in works:
        work.wait()
    assert torch.equal(sent, received)
