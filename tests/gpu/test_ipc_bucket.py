"""The CUDA IPC half of the ipc transport: a packed bucket read bit-exactly by a second process."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_ipc_bucket_opened_from_second_process_is_bit_exact():
    from vime.weight_sync.ipc_check import run_check

    report = run_check(num_mib=16, repeats=2)
    assert report["all_bit_exact"], report
