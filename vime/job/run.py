"""One rank of the RL job: set up, run the loop, tear down.

Every rank joins the process group and megatron's parallel state, builds its trainer (resumed
from a checkpoint if asked, before any engine starts, so a checkpoint that does not fit fails
fast), then starts the engines and the weight sync through `vime.plugin` (rank 0 launches, the
others attach), pins its threads beside the engines, and runs `vime.job.loop`. Rank 0 also runs
the rollouts, the metrics, the watchdog and (engine.fault_tolerance) the recovery. Any failure on
rank 0 aborts the job at once (`vime.job.abort`); the engines end with the job either way.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vime.cluster.addresses import HOST_IP_ENV, node_address
from vime.config import TrainConfig
from vime.fleet.fleet import Fleet
from vime.job.abort import abort
from vime.job.faults import EngineRecovery, FaultTolerance
from vime.job.loop import Job, run_loop
from vime.job.report import Reporter, write_summary
from vime.job.safe_points import SafePoints
from vime.job.stages import Evaluator
from vime.megatron.checkpoint import TrainingState, load_checkpoint
from vime.plugin import RolloutEngines, WeightSync
from vime.rl.metrics import MetricsWriter, drop_rows_from
from vime.utils.collectives import broadcast_object
from vime.utils.cores import spare_core
from vime.utils.dist_env import init_process_group

logger = logging.getLogger(__name__)


def run(config: TrainConfig) -> dict[str, Any]:
    """Run the job on this rank; rank 0 returns the summary figures (others: {})."""
    address = node_address(config.cluster.node_address, config.cluster.interface)
    # One node address for every process of this node (engines, gloo groups, stores).
    os.environ[HOST_IP_ENV] = address
    timeout = timedelta(seconds=config.weight_sync.barrier_timeout_s)
    rank, _ = init_process_group(timeout)
    run_dir = Path(config.run_dir)
    group = dist.new_group(backend="gloo", timeout=timeout)
    if rank == 0:
        _prepare_run_dir(config, run_dir)
    dist.barrier(group=group)
    trainer, topology = _build_trainer(config)
    resumed = _resume(config, trainer, run_dir, group)
    engines = None
    summary: dict[str, Any] = {}
    completed = False
    try:
        engines = RolloutEngines.start(
            config.engine,
            weight_sync=config.weight_sync,
            cluster=config.cluster,
            group=group,
            log_dir=run_dir / "engines",
        )
        if rank == 0:
            abort.run_dir, abort.engines = run_dir, engines.handles
            (run_dir / "engines.json").write_text(json.dumps(engines.describe(), indent=2))
        summary = _run(config, rank, run_dir, trainer, topology, engines, resumed)
        summary["model_chunks_per_rank"] = len(trainer.model)
        completed = True
    except Exception as exc:
        if rank == 0:
            logger.exception("the job failed")
            write_summary(run_dir, summary, exc)
            # Fail fast, as for a dead engine: an orderly shutdown (engines, then Ray draining)
            # takes tens of seconds; the keepers end the engines and Ray once this rank is gone.
            abort(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if engines is not None:
            engines.shutdown()  # servers run in their own process groups: end them
        if completed:
            dist.barrier(group=group)
        dist.destroy_process_group()
    if rank == 0:
        write_summary(run_dir, summary, None)
    return summary


def _prepare_run_dir(config: TrainConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    # Without the derived engine backend, so that the file loads back as a config.
    resolved = config.model_dump_json(indent=2, exclude={"engine": {"weight_transfer_backend"}})
    (run_dir / "config.resolved.json").write_text(resolved)
    model = config.model
    if model.preset is not None:
        from vime.testing.tiny_model import build_tiny_model

        build_tiny_model(config.engine.model_path, model.preset, model.dtype, model.seed)
    if model.pretrained is not None:
        from vime.pretrained import build_pretrained

        build_pretrained(model.pretrained, config.engine.model_path, model.dtype)


def _build_trainer(config: TrainConfig) -> tuple[Any, Any]:
    from megatron.core import parallel_state

    from vime.megatron.model import initialize_model_parallel
    from vime.trainer import MegatronTrainer

    topology = initialize_model_parallel(
        tp=config.trainer.tensor_parallel_size,
        pp=config.trainer.pipeline_parallel_size,
        vp=config.trainer.virtual_pipeline_parallel_size,
        timeout=timedelta(seconds=config.trainer.collective_timeout_s),
    )
    dp_group = parallel_state.get_data_parallel_group() if topology.dp_size > 1 else None
    trainer = MegatronTrainer(
        config.trainer,
        model_path=config.engine.model_path,
        topology=topology,
        grpo=config.grpo,
        dp_group=dp_group,
        temperature=config.rollout.temperature,
        top_p=config.rollout.top_p,
        top_k=config.rollout.top_k,
    )
    return trainer, topology


def _resume(config: TrainConfig, trainer: Any, run_dir: Path, group: Any) -> TrainingState | None:
    """Rank 0 picks the checkpoint to resume from and tells every rank; all load it, or none.
    The job's own lr, betas and weight decay apply, not the checkpoint's."""
    choice: tuple[str | None, str | None] = (None, None)  # (path, error)
    if dist.get_rank(group) == 0:
        try:
            found = config.checkpoint.resume_path(run_dir)
            choice = (str(found) if found else None, None)
            if found is None and config.checkpoint.resume is True:
                logger.info("checkpoint.resume: no complete checkpoint in %s; fresh", run_dir)
        except ValueError as exc:  # preflight checked it; the directory changed since
            choice = (None, str(exc))
    path, error = broadcast_object(choice, group)
    if error is not None:
        raise ValueError(error)
    if path is None:
        return None
    state = load_checkpoint(trainer, path)
    for param_group in trainer.optimizer.param_groups:
        param_group.update(
            lr=config.trainer.lr,
            betas=config.trainer.betas,
            weight_decay=config.trainer.weight_decay,
        )
    return state


def _pin_trainer(config: TrainConfig, engines: RolloutEngines) -> None:
    """CPU: after the engines started (they inherit nothing from here any more), train on the
    core a single local engine leaves free, so overlapped generation and training do not
    contend (trainer.cpu_cores)."""
    cores = config.trainer.cpu_cores
    if cores == "auto":
        spare = spare_core(
            sorted(os.sched_getaffinity(0)), engines.num_local(), config.engine.tensor_parallel_size
        )
        cores = None if spare is None else [spare]
    if cores and not torch.cuda.is_available():
        os.sched_setaffinity(0, set(cores))
        torch.set_num_threads(len(cores))
        logger.info("trainer pinned to cores %s", cores)


def _run(
    config: TrainConfig,
    rank: int,
    run_dir: Path,
    trainer: Any,
    topology: Any,
    engines: RolloutEngines,
    resumed: TrainingState | None,
) -> dict[str, Any]:
    """Connect the weight sync, start rank 0's rollouts and watchers, run the loop."""
    from transformers import AutoTokenizer

    from vime.engines.ray_engine import startup_bound
    from vime.engines.watchdog import EngineWatchdog
    from vime.rl.rollout import RolloutManager, RolloutThread

    _pin_trainer(config, engines)
    sync = WeightSync(
        trainer.model,
        hf_path=config.engine.model_path,
        engines=engines,
        config=config.weight_sync,
        topology=topology,
    )
    start_step = 0
    if resumed is None and config.engine.external_urls:
        # Attached engines may serve anything (another job's weights and labels): the trainer's
        # weights go in as version 0 before the first request.
        sync.update_weights(version=0)
    if resumed is not None:
        synced = sync.update_weights(version=resumed.weight_version)
        logger.info(
            "engines synced to the resumed weights (version %d) in %.2f s; continuing at step %d",
            sync.weight_version,
            synced.total_s,
            resumed.next_step,
        )
        start_step = resumed.next_step
        if rank == 0:
            # Rows the killed run wrote for steps it had not checkpointed are written again.
            for name in ("metrics.jsonl", "eval.jsonl", "rollouts.jsonl"):
                drop_rows_from(run_dir / name, start_step)
    tokenizer = AutoTokenizer.from_pretrained(config.engine.model_path)
    rollouts = writer = watchdog = recovery = None
    if rank == 0:
        client = engines.client(fault_tolerant=config.engine.fault_tolerance)
        rollouts = RolloutThread(RolloutManager(config.rollout, client=client, tokenizer=tokenizer))
        writer = MetricsWriter(run_dir, resume=resumed is not None)
        if config.engine.fault_tolerance:
            recovery = EngineRecovery(engines.handles, client, startup_bound(config.engine))
        watchdog = EngineWatchdog(
            engines.urls,
            recovery.on_failure if recovery else (lambda failure: abort(str(failure))),
            token=engines.token,
            interval_s=config.engine.watchdog_interval_s,
            progress_timeout_s=config.engine.progress_timeout_s,
        ).start()
        if recovery:
            recovery.watchdog = watchdog
    fleet = Fleet(
        config,
        engines,
        sync,
        run_dir,
        client=rollouts.client if rollouts is not None else None,
        watchdog=watchdog,
        recovery=recovery,
    )
    evaluate = Evaluator(config, rollouts, writer)
    report = Reporter(writer, num_steps=config.num_steps, start_step=start_step)
    job = Job(
        config=config,
        rank=rank,
        run_dir=run_dir,
        trainer=trainer,
        sync=sync,
        safe_points=SafePoints(
            FaultTolerance(sync, recovery, engines.group, config.engine.progress_timeout_s),
            fleet,
            rank,
            recovery,
        ),
        tokenizer=tokenizer,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        start_step=start_step,
        resumed=resumed is not None,
        rollouts=rollouts,
        evaluate=evaluate,
        report=report,
    )
    summary: dict[str, Any] = {}
    try:
        summary = run_loop(job)
    finally:
        fleet.close()
        summary.update(fleet.summary())
        if watchdog is not None:
            watchdog.stop()  # before the engines end on purpose
        if recovery is not None:
            recovery.close()
            summary.update(engine_restarts=recovery.num_restarts, recovery_s=recovery.recovery_s)
        if rollouts is not None and writer is not None:
            rollouts.close()
            writer.close()
        sync.close()
    summary["wall_s"] = time.time() - report.job_start
    if evaluate.results:
        summary["eval"] = evaluate.results
    summary["world_size"] = dist.get_world_size()
    return summary if rank == 0 else {}
