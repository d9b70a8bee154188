"""Asking a running job to change its fleet: `vime fleet join|leave --run-dir DIR` appends a line
to DIR/fleet-requests.jsonl, which the job's rank 0 reads at each step's safe point
(vime.fleet.fleet). Whoever may write the job's run directory may steer it; nothing listens on the
network."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)

REQUESTS_FILE = "fleet-requests.jsonl"


def request_change(run_dir: str | Path, *, join: int = 0, leave: list[int] | None = None) -> None:
    """Ask the job writing to `run_dir` to launch `join` engines or drain `leave` (read at its
    next step's safe point)."""
    run_dir = Path(run_dir)
    config = run_dir / "config.resolved.json"
    if not config.exists():
        raise ValueError(f"{run_dir} is not a job's run_dir (no config.resolved.json)")
    if join and json.loads(config.read_text()).get("engine", {}).get("external_urls"):
        raise ValueError(f"the job in {run_dir} reaches external engines: vime cannot launch more")
    if join < 0 or (not join and not leave):
        raise ValueError("ask for join >= 1 or leave = engine indices")
    line = json.dumps({"join": join, "leave": list(leave or []), "time": time.time()})
    with open(run_dir / REQUESTS_FILE, "a") as requests:
        requests.write(line + "\n")


def read_requests(run_dir: Path, start: int) -> tuple[list[tuple[int, list[int]]], int]:
    """(join, leave) of the request lines from line `start` on, and the lines read so far; a
    line that does not parse is logged and skipped."""
    path = run_dir / REQUESTS_FILE
    if not path.exists():
        return [], start
    lines = path.read_text().splitlines()
    found = []
    for line in lines[start:]:
        try:
            request = json.loads(line)
            found.append((int(request.get("join", 0)), [int(i) for i in request.get("leave", [])]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.error("%s: ignored the request %r: %s", path, line[:200], exc)
    return found, len(lines)


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
