"""What the Slurm job runs on each node: Ray head or worker, the wait for every node, the trainer.

Each command resolves this node's address (vime.cluster.addresses), exports it as VIME_HOST_IP,
and replaces itself with the real program, so Slurm tracks and signals that program directly:

    python -m vime.cluster.node ray --head --port 6379 [--engine-resource NAME] [--temp-dir D]
    python -m vime.cluster.node ray --address 10.0.0.5:6379 [--engine-resource NAME]
    python -m vime.cluster.node wait --address 10.0.0.5:6379 --nodes n1,n2 --timeout 180
    python -m vime.cluster.node trainer --nnodes 2 --nproc-per-node 8 \
        --rdzv-endpoint 10.0.0.5:29400 --rdzv-id 1234 -- --config CFG [a.b=value ...]

`ray` runs `ray start --block` as its child: it stays in the foreground, and SIGTERM or SIGINT
(what `scancel`, the end of the job's script, or srun's forwarding sends) goes on to it, which
stops every Ray process of that node. A start that fails before Ray reports it started (e.g. "The
current node timed out during startup", GCS not finding the new node) is retried with fresh
ports, `--start-attempts` in all, each failure logged; a Ray that fails after it started is not.
`--temp-dir` is this node's own: nodes that share a file system (or one machine) never share it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from vime.cluster.addresses import HOST_IP_ENV, node_address
from vime.cluster.ray_cluster import ray_start_argv
from vime.utils.net import free_ports

RAY_STARTED = "Ray runtime started."  # what `ray start` prints once the node runs


def slurm_node_name() -> str:
    name = os.environ.get("SLURMD_NODENAME")
    if not name:
        raise SystemExit("vime.cluster.node: SLURMD_NODENAME is not set; run it under srun")
    return name


def trainer_argv(
    *,
    address: str,
    nnodes: int,
    nproc_per_node: int,
    node_rank: int,
    rdzv_endpoint: str,
    rdzv_id: str,
    train_args: list[str],
) -> list[str]:
    """torchrun for this trainer node: c10d rendezvous hosted by trainer node 0."""
    return [
        "torchrun",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        # Exactly one node hosts the rendezvous store: with test nodes on one machine, every
        # loopback endpoint would look local to torchrun's guess.
        f"--rdzv-conf=is_host={1 if node_rank == 0 else 0}",
        f"--local-addr={address}",
        "-m",
        "vime.train",
        *train_args,
    ]


def run_ray(make_argv: Callable[[], list[str]], attempts: int, retry_delay_s: float = 2.0) -> int:
    """`ray start --block` (a fresh `make_argv()` each attempt) until it started or `attempts`
    starts failed; its exit status. SIGTERM/SIGINT are passed on to the running attempt."""
    child: subprocess.Popen | None = None
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.signal(signum, forward) for signum in signals}
    try:
        status = 1
        for attempt in range(1, attempts + 1):
            argv = make_argv()
            command = " ".join(argv)
            print(
                f"vime.cluster.node: ray start, attempt {attempt}/{attempts}: {command}", flush=True
            )
            child = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
            )
            started = threading.Event()
            # Its output, passed through to this step's log as it comes. On a thread: a process
            # Ray left behind may hold the pipe open after `ray start` itself ended.
            reader = threading.Thread(target=_pass_through, args=(child, started), daemon=True)
            reader.start()
            status = child.wait()
            reader.join(timeout=5)
            if status == 0 or started.is_set() or stopping:
                return status
            if attempt < attempts:
                print(
                    f"vime.cluster.node: ray start failed before the node started (exit status "
                    f"{status}); retrying in {retry_delay_s:g} s",
                    flush=True,
                )
                time.sleep(retry_delay_s)
                if stopping:
                    return status
        print(f"vime.cluster.node: ray start failed {attempts} times; giving up", flush=True)
        return status
    finally:  # the caller's handlers back (a test, an embedding process)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _pass_through(child: subprocess.Popen, started: threading.Event) -> None:
    assert child.stdout is not None
    for line in child.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if RAY_STARTED in line:
            started.set()


def _exec(argv: list[str], address: str) -> None:
    os.environ[HOST_IP_ENV] = address
    print(f"vime.cluster.node: {slurm_node_name()} ({address}): {' '.join(argv)}", flush=True)
    os.execvp(argv[0], argv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interface", default=None, help="take this interface's address")
    commands = parser.add_subparsers(dest="command", required=True)

    ray_cmd = commands.add_parser("ray", help="ray start --block on this node")
    role = ray_cmd.add_mutually_exclusive_group(required=True)
    role.add_argument("--head", action="store_true")
    role.add_argument("--address", help="head's host:port (workers)")
    ray_cmd.add_argument("--port", type=int, default=6379, help="GCS port (head)")
    ray_cmd.add_argument("--engine-resource", default=None, help="offer engine slots here")
    ray_cmd.add_argument("--temp-dir", default=None, help="this node's own Ray temp dir")
    ray_cmd.add_argument(
        "--start-attempts", type=int, default=3, help="starts tried before giving up (>= 1)"
    )

    wait_cmd = commands.add_parser("wait", help="wait until every node's Ray has joined")
    wait_cmd.add_argument("--address", required=True)
    wait_cmd.add_argument("--nodes", required=True, help="comma-separated Slurm node names")
    wait_cmd.add_argument("--timeout", type=float, required=True)

    trainer_cmd = commands.add_parser("trainer", help="torchrun -m vime.train on this node")
    trainer_cmd.add_argument("--nnodes", type=int, required=True)
    trainer_cmd.add_argument("--nproc-per-node", type=int, required=True)
    trainer_cmd.add_argument("--rdzv-endpoint", required=True)
    trainer_cmd.add_argument("--rdzv-id", required=True)
    trainer_cmd.add_argument("train_args", nargs=argparse.REMAINDER)

    args = parser.parse_args(argv)
    address = node_address(interface=args.interface)
    if args.command == "ray":
        if args.start_attempts < 1:
            parser.error(f"--start-attempts must be >= 1, got {args.start_attempts}")
        node_name = slurm_node_name()

        def make_argv() -> list[str]:
            # Free on every address: Ray's client server binds another one than the node's
            # (seen: 127.0.0.1 for a node on 127.0.0.2, its port taken there).
            agent_port, client_port = free_ports("0.0.0.0", 2)
            return ray_start_argv(
                address=address,
                node_name=node_name,
                head_port=args.port if args.head else None,
                head_address=args.address,
                engine_resource=args.engine_resource,
                temp_dir=args.temp_dir,
                dashboard_agent_port=agent_port,
                client_server_port=client_port,
            )

        os.environ[HOST_IP_ENV] = address
        print(f"vime.cluster.node: {node_name} ({address}): Ray", flush=True)
        raise SystemExit(run_ray(make_argv, args.start_attempts))
    elif args.command == "wait":
        import ray

        from vime.cluster.ray_cluster import wait_for_nodes

        ray.init(address=args.address, _node_ip_address=address, log_to_driver=False)
        try:
            wait_for_nodes(args.nodes.split(","), timeout_s=args.timeout)
        except TimeoutError as exc:
            raise SystemExit(f"vime.cluster.node wait: {exc}") from None
        finally:
            ray.shutdown()
        print(f"vime.cluster.node: every node joined Ray: {args.nodes}", flush=True)
    else:
        train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
        _exec(
            trainer_argv(
                address=address,
                nnodes=args.nnodes,
                nproc_per_node=args.nproc_per_node,
                node_rank=int(os.environ.get("SLURM_NODEID", "0")),
                rdzv_endpoint=args.rdzv_endpoint,
                rdzv_id=args.rdzv_id,
                train_args=train_args,
            ),
            address,
        )


if __name__ == "__main__":
    main()
