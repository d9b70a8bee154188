"""The two-node Slurm cluster of tools/slurm_cluster.sh, for tests: up once per session, then down.

Slurm is real (slurmctld + one slurmd per fake node, each node its own loopback address); the
daemons are started and stopped by that script, by pid. Without root or without slurm-wlm the
tests skip locally and fail in CI (CI=true), where scripts/setup.sh installs them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tools" / "slurm_cluster.sh"
NODE_ADDRESSES = {"vime-n1": "127.0.0.2", "vime-n2": "127.0.0.3"}


def slurm_env() -> dict[str, str]:
    shown = subprocess.run(
        ["bash", str(SCRIPT), "env"], capture_output=True, text=True, check=True, timeout=30
    )
    conf = shown.stdout.strip().split("=", 1)[1]
    return {**os.environ, "SLURM_CONF": conf}


def start_cluster() -> dict[str, str]:
    missing = [tool for tool in ("slurmctld", "slurmd", "munged") if not shutil.which(tool)]
    why = None
    if missing:
        why = f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)"
    elif os.geteuid() != 0:
        why = "the test Slurm cluster needs root (slurmd runs jobs as their user)"
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"two-node Slurm cluster unavailable in CI: {why}")
        pytest.skip(why)
    up = subprocess.run(["bash", str(SCRIPT), "up"], capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    return slurm_env()


def stop_cluster() -> None:
    subprocess.run(["bash", str(SCRIPT), "down"], capture_output=True, text=True, timeout=120)


def processes_of_job(job_id: str) -> list[tuple[int, str]]:
    """Every live process whose environment says it belongs to Slurm job `job_id`."""
    found = []
    marker = f"SLURM_JOB_ID={job_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in environ and state != "Z":
            found.append((int(entry.name), cmdline[:200]))
    return found
