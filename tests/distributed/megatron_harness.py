"""Run real megatron-core on several gloo processes on 127.0.0.1, for the distributed tests.

`run_workers(job, world_size, out_dir)` spawns `world_size` processes, each runs `_worker`:
initialise gloo and megatron's parallel_state for one parallel layout, then for every case build
the model from an HF checkpoint, load it, gather it back to HF names and (fp32, PP=1) run the
forward. Each rank writes what it saw to out_dir/rank{r}.pt; the test process asserts on it.
Every wait is bounded: gloo groups carry a timeout, and the parent kills the processes it spawned
when the deadline passes.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from vime.utils.net import free_port

COLLECTIVE_TIMEOUT = timedelta(seconds=90)


@dataclass(frozen=True)
class Case:
    """One model to load and gather: an HF checkpoint dir and the parameter dtype."""

    model_dir: str
    dtype: str = "float32"
    forward: bool = False  # also compute logits and log-probs on `Job.input_ids`
    te_names: bool = False  # gather through the Transformer Engine names view (te_names.py)


@dataclass(frozen=True)
class Job:
    """A parallel layout and the cases to run under it."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    expert_tp: int | None = None
    cases: tuple[Case, ...] = ()
    # Forces vocab padding: 512 -> 576 at TP1 and TP2.
    make_vocab_size_divisible_by: int = 96
    input_ids: tuple[tuple[int, ...], ...] = field(default=())


def build_tied_variant(src: Path, out: Path) -> Path:
    """The same checkpoint with tie_word_embeddings=True and no lm_head.weight."""
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            shutil.copy(file, out / file.name)
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(config))
    state = load_file(src / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def init_gloo_rank(rank: int, world_size: int, port: int) -> None:
    """This spawned process joins the test's gloo world on loopback, one thread per rank."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def _worker(rank: int, world_size: int, port: int, job: Job, out_dir: str) -> None:
    import torch.distributed as dist
    from te_names import TENamedModel

    from vime.megatron.forward import forward_logits, token_logprobs
    from vime.megatron.gather import GatherGroups, GatherPlan
    from vime.megatron.model import (
        build_from_hf,
        initialize_model_parallel,
    )
    from vime.megatron.topology import Topology

    init_gloo_rank(rank, world_size, port)
    topology = initialize_model_parallel(
        tp=job.tp, pp=job.pp, ep=job.ep, expert_tp=job.expert_tp, timeout=COLLECTIVE_TIMEOUT
    )
    expected = Topology.for_rank(
        rank, world_size, tp=job.tp, pp=job.pp, ep=job.ep, expert_tp=job.expert_tp
    )
    groups = GatherGroups.from_parallel_state()
    result: dict = {"topology": topology, "expected_topology": expected, "cases": {}}
    for case in job.cases:
        model, converter = build_from_hf(
            case.model_dir,
            topology,
            params_dtype=getattr(torch, case.dtype),
            vocab_divisible_by=job.make_vocab_size_divisible_by,
        )
        view = TENamedModel(model) if case.te_names else model
        plan = GatherPlan(view, converter=converter, topology=topology)
        gathered = [
            (name, tensor.clone())
            for name, tensor in plan.gather(groups, timeout=COLLECTIVE_TIMEOUT)
        ]
        case_result = {
            "gathered": gathered,
            "stage_metadata": plan.stage_metadata(),
            "layout": plan.layout,
            "names": [name for name, _ in view.named_parameters()],
            "padded_vocab_size": converter.dims.padded_vocab_size,
        }
        if case.forward:
            input_ids = torch.tensor(job.input_ids)
            # eval(): megatron refuses MoE + TP without sequence parallelism in training mode.
            model.eval()
            with torch.no_grad():
                case_result["logits"] = forward_logits(
                    model, input_ids, vocab_size=converter.dims.vocab_size
                )
                case_result["logprobs"] = token_logprobs(
                    model, input_ids, vocab_size=converter.dims.vocab_size
                )
        result["cases"][(case.model_dir, case.dtype, case.te_names)] = case_result
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(target, world_size: int, args: tuple, *, timeout_s: float, what: str) -> None:
    """Run `target(rank, world_size, port, *args)` on `world_size` spawned processes.

    Kills the processes it spawned (only those) when `timeout_s` passes or one of them fails.
    """
    context = mp.start_processes(
        target,
        args=(world_size, free_port(), *args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not finish within {timeout_s} s ({what})")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


def run_workers(job: Job, world_size: int, out_dir: Path, *, timeout_s: float = 150.0) -> list:
    """Run `job` on `world_size` spawned gloo processes; return each rank's result, rank order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_worker, world_size, (job, str(out_dir)), timeout_s=timeout_s, what=str(job))
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
