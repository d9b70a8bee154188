import socket

import pytest

from vime.utils.net import ephemeral_port_range, free_port, free_ports

pytestmark = pytest.mark.unit


def test_chosen_ports_lie_outside_the_kernels_ephemeral_range():
    low, high = ephemeral_port_range()
    ports = free_ports("127.0.0.1", 8)
    assert len(set(ports)) == 8
    assert not any(low <= port <= high for port in ports)
    assert not any(10002 <= port <= 19999 for port in ports)  # Ray's worker ports


def test_a_range_gives_its_lowest_free_port_and_names_itself_when_full():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        assert free_port("127.0.0.1", (taken, taken + 1)) == taken + 1
        with pytest.raises(RuntimeError, match=f"no free port at 127.0.0.1 in {taken}-{taken}"):
            free_port("127.0.0.1", (taken, taken))
