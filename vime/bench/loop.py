"""`vime bench-loop`: the RL loop at several staleness bounds, same job, one run each.

    vime bench-loop                                       # configs/bench_loop_cpu.yaml, K = 0 1
    vime bench-loop --staleness 0 1 2 4 --steps 16
    vime bench-loop --config configs/tiny_cpu_async.yaml --steps 12 rollout.max_tokens=16

Runs the job (`python -m torch.distributed.run -m vime.train`) once per `rollout.max_staleness`
K with the same config and overrides (K = 0: generate, train, sync in turn; K >= 1: up to K
batches generate while the trainer trains) and compares their steady-state step times (the
first `--skip` steps, which include warm-up, are left out). Per K it also prints the mean
generation, training and sync times per step, the trainer's wait for its batch, the share of time
the engines had requests in flight, the mean lag of the samples trained on, the samples dropped
as too stale and the mean reward of the timed steps. Figures go to `--out`/bench_loop.json.
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

    def mean_of(key: str) -> float:
        values = [r[key] for r in steady if key in r]
        return mean(values) if values else float("nan")

    step_s = (ends[-1] - ends[skip - 1 if skip else 0]) / (len(records) - max(skip, 1))
    return {
        "step_s": step_s,
        "samples_per_s": mean_of("rollout/num_samples") / step_s,
        "generate_s": mean(r["time/gen_end"] - r["time/gen_start"] for r in steady),
        "train_s": mean(r["time/train_end"] - r["time/train_start"] for r in steady),
        "sync_s": mean_of("sync/time_s"),
        "batch_wait_s": mean_of("time/batch_wait_s"),
        "engine_occupied": mean_of("rollout/engine_occupied_fraction"),
        "lag_mean": mean_of("staleness/lag_mean"),
        "dropped_stale": sum(r.get("rollout/dropped_stale", 0.0) for r in steady),
        "reward_mean": mean_of("rollout/reward_mean"),
        "prompt_cache_hit_rate": mean_of("rollout/prompt_cache_hit_rate"),
        "logprob_diff_same_version": mean_of("train/logprob_diff_same_version"),
        "mismatch_kl": mean_of("train/mismatch_kl"),
        "reward_last": steady[-1].get("rollout/reward_mean", float("nan")),
        "steps_timed": len(records) - max(skip, 1),
    }


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines if line.strip()), key=lambda r: r["step"])


def held_out_pass_at_1(run_dir: Path) -> float:
    """The job's held-out greedy pass@1 after training (NaN when the config has no eval)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    after = (summary.get("eval") or {}).get("after") or {}
    return float(after.get("eval/pass_at_1", float("nan")))


def run_job(config: str, staleness: int, run_dir: Path, steps: int, overrides: list[str]) -> float:
    """Run one job to the end; its wall time in seconds. Raises if it fails."""
    command = torchrun_command(
        config,
        f"rollout.max_staleness={staleness}",
        f"num_steps={steps}",
        f"run_dir={run_dir}",
        *overrides,
    )
    log_path = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with open(log_path, "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(
            f"the job at max_staleness {staleness} failed (exit {result.returncode}); log "
            f"tail:\n{tail}"
        )
    return time.monotonic() - began


def format_report(figures: dict[int, dict[str, float]]) -> str:
    """One row per staleness bound K; the speed-up of each K over K = 0 when it ran."""
    header = (
        f"{'K':>3} {'step s':>7} {'samples/s':>9} {'gen s':>6} {'train s':>7} {'sync s':>6} "
        f"{'wait s':>6} {'engines':>7} {'lag':>5} {'dropped':>7} {'reward':>6} {'pass@1':>6}"
    )
    lines = [header, "-" * len(header)]
    for k, f in sorted(figures.items()):
        lines.append(
            f"{k:>3} {f['step_s']:7.3f} {f['samples_per_s']:9.1f} {f['generate_s']:6.3f} "
            f"{f['train_s']:7.3f} {f['sync_s']:6.3f} {f['batch_wait_s']:6.3f} "
            f"{f['engine_occupied']:7.2f} {f['lag_mean']:5.2f} {f['dropped_stale']:7.0f} "
            f"{f['reward_mean']:6.3f} {f.get('pass_at_1_after', float('nan')):6.3f}"
        )
    if 0 in figures:
        for k in sorted(set(figures) - {0}):
            speedup = figures[0]["step_s"] / figures[k]["step_s"]
            lines.append(f"K={k}: step throughput {speedup:.2f}x K=0's")
        lines.append(
            "ideal for any K >= 1 from K=0's own phases (overlap of generation and training): "
            f"{ideal_speedup(figures[0]):.2f}x"
        )
    return "\n".join(lines)


def ideal_speedup(sync_loop: dict[str, float]) -> float:
    """(G + T + S) / (max(G, T) + S): generating ahead at best overlaps generation G with
    training T, each as long as in the synchronous loop, and still stops both for the sync S."""
    g, t, s = sync_loop["generate_s"], sync_loop["train_s"], sync_loop["sync_s"]
    return (g + t + s) / (max(g, t) + s)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="vime bench-loop", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="K values")
    parser.add_argument("--steps", type=int, default=12, help="steps per run")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the mean")
    parser.add_argument("--out", default="runs/bench-loop")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    args = parser.parse_args(argv)
    if args.steps < args.skip + 2:
        parser.error(f"--steps must be at least --skip + 2 = {args.skip + 2}")
    if any(k < 0 for k in args.staleness):
        parser.error(f"--staleness values must be >= 0, got {args.staleness}")
    out = Path(args.out)
    figures: dict[int, dict[str, float]] = {}
    wall: dict[int, float] = {}
    for k in args.staleness:
        run_dir = out / f"staleness-{k}"
        print(f"bench-loop: max_staleness {k} ({args.steps} steps) ...", flush=True)
        wall[k] = run_job(args.config, k, run_dir, args.steps, args.overrides)
        figures[k] = step_figures(read_metrics(run_dir), args.skip)
        figures[k]["pass_at_1_after"] = held_out_pass_at_1(run_dir)
    document = {
        "command": "vime bench-loop " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": args.config,
        "overrides": args.overrides,
        "figures": {str(k): f for k, f in figures.items()},
        "job_wall_s": {str(k): w for k, w in wall.items()},
        "steps_timed": args.steps - max(args.skip, 1),
    }
    if 0 in figures:
        document["speedup_over_0"] = {
            str(k): figures[0]["step_s"] / figures[k]["step_s"] for k in figures
        }
        document["ideal_speedup"] = ideal_speedup(figures[0])
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_loop.json").write_text(json.dumps(document, indent=2))
    print(format_report(figures))
    print(f"figures: {out / 'bench_loop.json'}")
    return document


if __name__ == "__main__":
    main()
