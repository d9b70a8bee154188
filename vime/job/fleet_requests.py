"""Asking a running job to change its fleet: `vime fleet join|leave --run-dir DIR` appends a line
to DIR/fleet-requests.jsonl, which the job's rank 0 reads at each step's safe point
(vime.job.fleet). Whoever may write the job's run directory may steer it; nothing listens on the
network."""

from __future__ import annotations

import json
import time
from pathlib import Path

REQUESTS_FILE = "fleet-requests.jsonl"


def request_change(run_dir: str | Path, *, join: int = 0, leave: list[int] | None = None) -> None:
    """Ask the job writing to `run_dir` to launch `join` engines or drain `leave` (read at its
    next step's safe point)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.resolved.json").exists():
        raise ValueError(f"{run_dir} is not a job's run_dir (no config.resolved.json)")
    if join < 0 or (not join and not leave):
        raise ValueError("ask for join >= 1 or leave = engine indices")
    line = json.dumps({"join": join, "leave": list(leave or []), "time": time.time()})
    with open(run_dir / REQUESTS_FILE, "a") as requests:
        requests.write(line + "\n")


def main(argv: list[str] | None = None) -> None:
    """`vime fleet join --run-dir DIR [--count N]` / `vime fleet leave --run-dir DIR --engine I`."""
    import argparse

    parser = argparse.ArgumentParser(prog="vime fleet", description=main.__doc__)
    parser.add_argument("action", choices=["join", "leave"])
    parser.add_argument("--run-dir", required=True, help="the running job's run_dir")
    parser.add_argument("--count", type=int, default=1, help="join: engines to launch")
    parser.add_argument("--engine", type=int, nargs="+", default=[], help="leave: indices")
    args = parser.parse_args(argv)
    try:
        if args.action == "join":
            request_change(args.run_dir, join=args.count)
        else:
            request_change(args.run_dir, leave=args.engine)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"asked: {args.action} (read at the job's next step)")
