"""The shipped colocated transport (CUDA IPC plug-in) into a second process that opens its
handles with the engine receiver's plug-in code: every tensor read back bit for bit."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_ipc_transport_buckets_read_bit_exactly_by_a_second_process():
    from vime.weight_sync.ipc_check import run_check

    report = run_check(num_mib=16, repeats=2)
    assert report["all_bit_exact"], report
