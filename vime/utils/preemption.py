"""Preemption notices: a keeper started with --preempt-grace-s takes a first SIGTERM as notice
that its node is going away (vime.utils.keeper), writes it into the server's TMPDIR, and the job
reads it from there (`read_notice`, through the engine's actor) to drain the engine in time."""

from __future__ import annotations

import os
import time

PREEMPT_NOTICE = "vime-preempted"  # in the server's TMPDIR: the notice's time and the grace


def write_notice(temp_dir: str, grace_s: float) -> None:
    """The preemption notice the job reads (`read_notice`): when it came, how long is left."""
    path = os.path.join(temp_dir, PREEMPT_NOTICE)
    with open(path + ".tmp", "w") as notice:
        notice.write(f"{time.time()} {grace_s}\n")
    os.replace(path + ".tmp", path)
    print(
        f"vime keeper {os.getpid()}: SIGTERM: preemption notice; the group ends in "
        f"{grace_s:g} s (at once on SIGINT or a second SIGTERM)",
        flush=True,
    )


def read_notice(temp_dir: str | None) -> dict[str, float] | None:
    """The keeper's preemption notice in `temp_dir` (the server's TMPDIR): {"age_s", "left_s"}
    (seconds since the SIGTERM, seconds until the keeper ends the group); None without one."""
    if not temp_dir:
        return None
    try:
        with open(os.path.join(temp_dir, PREEMPT_NOTICE)) as notice:
            at, grace_s = (float(x) for x in notice.read().split())
    except (OSError, ValueError):
        return None
    age = max(0.0, time.time() - at)
    return {"age_s": age, "left_s": max(0.0, grace_s - age)}
