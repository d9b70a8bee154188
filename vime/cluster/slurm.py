"""`vime slurm CONFIG [a.b=value ...] [--dry-run]`: render the job's sbatch script, submit it.

    vime slurm configs/slurm_cpu_2node.yaml --dry-run   # writes the script, prints `sbatch PATH`
    vime slurm configs/slurm_cpu_2node.yaml             # writes it, submits it, prints the job id

The script comes from job.sbatch.tmpl beside this file, filled from the config's `cluster.slurm`
section: a Ray head on the first node and Ray workers on the others (`ray start --block`, one
background step each), a wait until every node has joined, then `torchrun -m vime.train` on the
trainer nodes; the trainer's rank 0 places the engines on the engine nodes (or on the trainer
nodes when colocated). At exit the script stops the Ray steps it started, and nothing else.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from vime.config import ClusterConfig

TEMPLATE = Path(__file__).with_name("job.sbatch.tmpl")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def fill(template: str, values: dict[str, str]) -> str:
    """Replace every {{name}}; a name without a value (or a value never used) is an error."""
    used = set()

    def substitute(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise KeyError(f"template placeholder {{{{{name}}}}} has no value")
        used.add(name)
        return values[name]

    text = _PLACEHOLDER.sub(substitute, template)
    unused = set(values) - used
    if unused:
        raise KeyError(f"values never used by the template: {sorted(unused)}")
    return text


def check_layout(config: Any) -> None:
    """Errors a user can make in the cluster/engine/weight_sync combination, said before sbatch."""
    slurm = config.cluster.slurm
    if config.engine.external_urls:
        return
    transport = config.weight_sync.transport
    if transport.sync_shape == "colocated" and not slurm.colocated:
        raise ValueError(
            f"weight_sync.transport {transport.kind!r} reads the trainer's memory on the "
            f"engine's node, but cluster.slurm puts the engines on {slurm.engine_nodes} node(s) "
            f"of their own: set cluster.slurm.trainer_nodes={slurm.nodes} (colocated) or "
            "weight_sync.transport gloo (CPU) / nccl (GPU)"
        )
    engine_hosts = slurm.trainer_nodes if slurm.colocated else slurm.engine_nodes
    if config.cluster.placement_strategy == "STRICT_SPREAD" and (
        config.engine.num_engines > engine_hosts
    ):
        raise ValueError(
            f"cluster.placement_strategy='STRICT_SPREAD' puts each of engine.num_engines="
            f"{config.engine.num_engines} engines on a node of its own, but only {engine_hosts} "
            "node(s) serve engines: add nodes or use SPREAD/PACK"
        )


def _node_span(first: int, end: int) -> str:
    return f"node {first}" if end - first == 1 else f"nodes {first}-{end - 1}"


def layout_comment(config: Any) -> str:
    """The '# ...' lines saying what each node runs and how the weight-sync group is laid out."""
    slurm = config.cluster.slurm
    engine = config.engine
    lines = [f"# Layout ({slurm.nodes} node(s)):"]
    trainer_ranks = slurm.trainer_nodes * slurm.procs_per_node
    lines.append(
        f"#   {_node_span(0, slurm.trainer_nodes)}: trainer, torchrun {slurm.trainer_nodes} x "
        f"{slurm.procs_per_node} = {trainer_ranks} ranks (TP {config.trainer.tensor_parallel_size},"
        f" PP {config.trainer.pipeline_parallel_size}); node 0 also runs the Ray head"
    )
    if engine.external_urls:
        lines.append(f"#   engines: external, {', '.join(engine.external_urls)}")
    else:
        where = (
            "on the trainer nodes (colocated)"
            if slurm.colocated
            else f"on {_node_span(slurm.trainer_nodes, slurm.nodes)}"
        )
        lines.append(
            f"#   engines: {engine.num_engines} vLLM engine(s) x TP {engine.tensor_parallel_size} "
            f"{where}, Ray placement {config.cluster.placement_strategy}"
        )
    lines.append(
        f"#   weight sync: {config.weight_sync.transport.kind} "
        f"({config.weight_sync.transport.sync_shape}), from each "
        "pipeline stage's sender"
    )
    if config.weight_sync.transport.sync_shape == "broadcast" and not engine.external_urls:
        tp = engine.tensor_parallel_size
        offsets = [1 + index * tp for index in range(engine.num_engines)]
        lines.append(
            f"#   weight-sync group per stage: world size {1 + engine.num_engines * tp} "
            f"(sender rank 0), engine rank offsets {offsets}"
        )
    return "\n".join(lines)


def render(
    config: Any, *, config_path: str, overrides: list[str], workdir: str | None = None
) -> str:
    """The sbatch script of `config` (a vime.train.TrainConfig) as text."""
    check_layout(config)
    cluster: ClusterConfig = config.cluster
    slurm = cluster.slurm
    workdir = str(Path(workdir or slurm.workdir or Path.cwd()).resolve())
    options = []
    if slurm.partition:
        options.append(f"--partition={slurm.partition}")
    if slurm.account:
        options.append(f"--account={slurm.account}")
    options.append(f"--time={slurm.time}")
    if slurm.gpus_per_node:
        options.append(f"--gpus-per-node={slurm.gpus_per_node}")
    if slurm.cpus_per_node:
        options.append(f"--cpus-per-task={slurm.cpus_per_node}")
    if slurm.exclusive:
        options.append("--exclusive")
    options += slurm.sbatch_args
    if slurm.colocated:
        engine_nodes = 'ENGINE_NODES=("${TRAINER_NODES[@]}")  # colocated'
    else:
        engine_nodes = f'ENGINE_NODES=("${{NODES[@]:{slurm.trainer_nodes}}}")'
    values = {
        "layout": layout_comment(config),
        "job_name": cluster.job_name,
        "nodes": str(slurm.nodes),
        "log_dir": shlex.quote(slurm.log_dir),
        "workdir": workdir,
        "sbatch_options": "\n".join(f"#SBATCH {option}" for option in options),
        "setup": "\n".join(slurm.setup) or "# (none)",
        "env": "\n".join(f"export {name}={shlex.quote(value)}" for name, value in slurm.env.items())
        or "# (none)",
        "config": shlex.quote(_path_in(workdir, config_path)),
        "overrides": " ".join(shlex.quote(item) for item in overrides),
        "trainer_nodes": str(slurm.trainer_nodes),
        "engine_nodes": engine_nodes,
        "interface_arg": f" --interface {shlex.quote(cluster.interface)}"
        if cluster.interface
        else "",
        "ray_port": str(slurm.ray_port),
        "engine_resource": shlex.quote(cluster.engine_resource or "vime_engine_node"),
        "srun_args": "".join(f"{shlex.quote(arg)} " for arg in slurm.srun_args),
        "join_timeout_s": f"{slurm.join_timeout_s:g}",
        "procs_per_node": str(slurm.procs_per_node),
        "rdzv_port": str(slurm.rdzv_port),
    }
    return fill(TEMPLATE.read_text(), values)


def _path_in(workdir: str, path: str) -> str:
    """`path` relative to the job's workdir when it lies inside it, else absolute."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(workdir)) if resolved.is_relative_to(workdir) else str(resolved)


def write_script(text: str, script_dir: str, job_name: str) -> Path:
    path = Path(script_dir) / f"{job_name}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def submit(path: Path) -> str:
    """sbatch PATH; the job id. RuntimeError with sbatch's message if it refuses."""
    try:
        done = subprocess.run(
            ["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError:
        raise RuntimeError("sbatch not found: run on a Slurm node, or use --dry-run") from None
    if done.returncode != 0:
        raise RuntimeError(f"sbatch {path} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]


def main(argv: list[str] | None = None) -> None:
    from vime.config import TrainConfig, load_config

    parser = argparse.ArgumentParser(
        prog="vime slurm", description="Render (and submit) the sbatch script of a job config."
    )
    parser.add_argument("config", help="YAML job config with a cluster.slurm section")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. num_steps=5")
    parser.add_argument("--dry-run", action="store_true", help="write the script, do not submit")
    args = parser.parse_intermixed_args(argv)  # --dry-run may stand anywhere
    try:
        config = load_config(TrainConfig, args.config, args.overrides)
        text = render(config, config_path=args.config, overrides=args.overrides)
    except (ValueError, OSError) as exc:
        print(f"vime slurm: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    slurm = config.cluster.slurm
    path = write_script(text, slurm.script_dir, config.cluster.job_name)
    # Slurm opens the batch output before the script runs: its folder must exist.
    (Path(slurm.workdir or Path.cwd()) / slurm.log_dir).mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        print(f"sbatch {path}")
        return
    try:
        job_id = submit(path)
    except RuntimeError as exc:
        print(f"vime slurm: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    print(job_id)


if __name__ == "__main__":
    main()
