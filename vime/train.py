"""The async RL job: megatron trainer ranks, vLLM engines (Ray actors), weight sync every step.

    torchrun --nproc-per-node 1 -m vime.train --config configs/tiny_cpu_async.yaml [a.b=value ...]

The config is loaded and checked (`vime.job.preflight`: every path, data file and the reward
function) before any process group, Ray or engine starts: a bad one exits with code 2 and names
the field. Then every rank runs `vime.job.run`: rank 0 joins the Ray cluster named by
`cluster.ray_address` (or $RAY_ADDRESS; else it starts a local one of its own) and places the
engines (or reaches `engine.external_urls`), every rank trains and takes part in each sync, all
through `vime.plugin`; the loop is `vime.job.loop`. Multi-node jobs are rendered and submitted
by `vime slurm` (vime/cluster/slurm.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from vime.config import TrainConfig, load_config
from vime.job.abort import abort
from vime.job.preflight import preflight
from vime.utils.lifetime import watch_parent
from vime.utils.quiet import quiet_known_warnings


def torchrun_command(config: str | Path, *overrides: str, nproc: int = 1) -> list[str]:
    """`torchrun -m vime.train` for a job on this host (rendezvous on a free loopback port), run by
    this interpreter: what tests, benchmarks and tools start jobs with."""
    from vime.utils.net import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "vime.train",
        "--config",
        str(config),
        *overrides,
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file, e.g. configs/*.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. num_steps=5")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s"
    )
    quiet_known_warnings()
    try:
        config = preflight(load_config(TrainConfig, args.config, args.overrides))
    except (ValueError, OSError) as exc:
        # Fail before any process group, engine or model exists; the message names the field.
        print(f"vime.train: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from vime.job.run import run

    watch_parent(abort)  # torchrun SIGKILLed would leave this rank running on, unattended
    summary = run(config)
    if summary:
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
