"""`vime bench-loop`: step throughput of the sync and the async RL loop, same job, one run.

    vime bench-loop                                       # configs/bench_loop_cpu.yaml
    vime bench-loop --config configs/tiny_cpu_async.yaml --steps 12 rollout.max_tokens=16

Runs the job (`python -m torch.distributed.run -m vime.train`) twice with the same config and
overrides, once with `loop=sync` (generate, train, sync in turn) and once with `loop=async`
(generation of batch k+1 overlaps training on batch k), and compares their steady-state step
times (the first `--skip` steps, which include warm-up, are left out). Per loop it also prints the
mean generation, training and sync times per step, so it shows whether generation and training
were balanced, the case the async loop is built for. Figures go to `--out`/bench_loop.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

from vime.train import torchrun_command

DEFAULT_CONFIG = "configs/bench_loop_cpu.yaml"


def step_figures(records: list[dict[str, Any]], skip: int) -> dict[str, float]:
    """Steady-state means from a run's metrics.jsonl records (one per step, in step order)."""
    if len(records) < skip + 2:
        raise ValueError(
            f"{len(records)} steps recorded; need at least {skip + 2} to skip {skip} and time one"
        )
    ends = [r["time/step_end"] for r in records]
    steady = records[skip:]
    return {
        "step_s": (ends[-1] - ends[skip - 1 if skip else 0]) / (len(records) - max(skip, 1)),
        "generate_s": mean(r["time/gen_end"] - r["time/gen_start"] for r in steady),
        "train_s": mean(r["time/train_end"] - r["time/train_start"] for r in steady),
        "sync_s": mean(r["sync/time_s"] for r in steady),
        "reward_last": steady[-1].get("rollout/reward_mean", float("nan")),
        "steps_timed": len(records) - max(skip, 1),
    }


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines if line.strip()), key=lambda r: r["step"])


def run_job(config: str, loop: str, run_dir: Path, steps: int, overrides: list[str]) -> float:
    """Run one job to the end; its wall time in seconds. Raises if it fails."""
    command = torchrun_command(
        config, f"loop={loop}", f"num_steps={steps}", f"run_dir={run_dir}", *overrides
    )
    log_path = run_dir.parent / f"{loop}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with open(log_path, "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"the {loop} job failed (exit {result.returncode}); log tail:\n{tail}")
    return time.monotonic() - began


def format_report(figures: dict[str, dict[str, float]]) -> str:
    header = f"{'loop':>6} {'step s':>8} {'steps/s':>8} {'gen s':>8} {'train s':>8} {'sync s':>8}"
    lines = [header, "-" * len(header)]
    for loop, f in figures.items():
        lines.append(
            f"{loop:>6} {f['step_s']:8.3f} {1 / f['step_s']:8.2f} {f['generate_s']:8.3f} "
            f"{f['train_s']:8.3f} {f['sync_s']:8.3f}"
        )
    if {"sync", "async"} <= figures.keys():
        speedup = figures["sync"]["step_s"] / figures["async"]["step_s"]
        lines.append(
            f"async step throughput = {speedup:.2f}x the sync loop's (ideal from the sync loop's "
            f"own phases: {ideal_speedup(figures['sync']):.2f}x)"
        )
    return "\n".join(lines)


def ideal_speedup(sync_loop: dict[str, float]) -> float:
    """(G + T + S) / (max(G, T) + S): the async loop at best overlaps generation G with training
    T, each as long as in the sync loop, and still stops both for the sync S."""
    g, t, s = sync_loop["generate_s"], sync_loop["train_s"], sync_loop["sync_s"]
    return (g + t + s) / (max(g, t) + s)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="vime bench-loop", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--steps", type=int, default=12, help="steps per loop")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the mean")
    parser.add_argument("--out", default="runs/bench-loop")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for both runs")
    args = parser.parse_args(argv)
    if args.steps < args.skip + 2:
        parser.error(f"--steps must be at least --skip + 2 = {args.skip + 2}")
    out = Path(args.out)
    figures, wall = {}, {}
    for loop in ("sync", "async"):
        run_dir = out / loop
        print(f"bench-loop: running the {loop} loop ({args.steps} steps) ...", flush=True)
        wall[loop] = run_job(args.config, loop, run_dir, args.steps, args.overrides)
        figures[loop] = step_figures(read_metrics(run_dir), args.skip)
    document = {
        "command": "vime bench-loop " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": args.config,
        "overrides": args.overrides,
        "figures": figures,
        "job_wall_s": wall,
        "async_speedup": figures["sync"]["step_s"] / figures["async"]["step_s"],
        "ideal_speedup": ideal_speedup(figures["sync"]),
        "steps_timed": args.steps - args.skip,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_loop.json").write_text(json.dumps(document, indent=2))
    print(format_report(figures))
    print(f"figures: {out / 'bench_loop.json'}")
    return document


if __name__ == "__main__":
    main()
