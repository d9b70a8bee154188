"""The async RL job: megatron trainer ranks, vLLM engines (Ray actors), weight sync every step.

    torchrun --nproc-per-node 1 -m vime.train --config configs/tiny_cpu_async.yaml [a.b=value ...]

Rank 0 joins the Ray cluster named by `cluster.ray_address` (or $RAY_ADDRESS; else it starts a
local one of its own), places the engines as named Ray actors (or attaches to
`engine.external_urls`), and runs the rollout thread; every rank trains and takes part in the sync.
Multi-node jobs are rendered and submitted by `vime slurm` (vime/cluster/slurm.py).

Loop (`loop: async`, one-off pipelining): generation of batch k+1 is submitted before training on
batch k starts, so the engines generate while the trainer trains; the sync after step k pauses the
engines with `keep`, and the in-flight requests of batch k+1 continue on the new weights.
`loop: sync` generates, trains, syncs, one after the other.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field, model_validator

from vime.cluster.addresses import HOST_IP_ENV, node_address
from vime.cluster.config import ClusterConfig
from vime.config import EngineConfig, StrictModel, WeightSyncConfig, load_config
from vime.megatron.checkpoint import (
    CheckpointConfig,
    TrainingState,
    load_checkpoint,
    save_checkpoint,
)
from vime.plugin import RolloutEngines, WeightSync
from vime.rl.evaluate import EvalConfig, eval_metrics
from vime.rl.loss import GRPOConfig
from vime.rl.metrics import MetricsWriter, drop_rows_from, prefixed
from vime.rl.rollout import RolloutConfig
from vime.rl.sft import SFTConfig, load_demonstrations, sft_batch
from vime.rollout.recovery import EngineRecovery
from vime.rollout.watchdog import EngineWatchdog
from vime.trainer import TrainerConfig
from vime.utils.dist_env import init_process_group
from vime.utils.lifetime import watch_parent
from vime.weight_sync.session import WeightSyncError

logger = logging.getLogger("vime.train")


class ModelBuildConfig(StrictModel):
    """Build the tiny checkpoint at engine.model_path if it is absent (no downloads)."""

    preset: str | None = Field(
        None, description="vime.testing.tiny_model preset to build; None: the path must exist."
    )
    dtype: str = Field("float32", description="dtype of the built checkpoint.")
    seed: int = Field(0, description="Seed of the built random weights.")


class TrainConfig(StrictModel):
    """The root of a job's config tree (configs/*.yaml)."""

    run_dir: str = Field("runs/tiny-cpu-async", description="Where metrics, plots and logs go.")
    num_steps: int = Field(20, ge=1, description="Optimizer steps (= weight syncs).")
    save_rollouts: bool = Field(
        False,
        description=(
            "Append every step's samples (prompt and response token ids, rollout log-probs, "
            "per-token weight versions, reward, lag) to run_dir/rollouts.jsonl, for debugging "
            "and replay."
        ),
    )
    loop: Literal["async", "sync"] = Field(
        "async", description="async: one-off pipelining; sync: generate -> train -> sync."
    )
    model: ModelBuildConfig = Field(default_factory=ModelBuildConfig)
    engine: EngineConfig = Field(description="The rollout engines.")
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    rollout: RolloutConfig = Field(description="Prompts, sampling and rewards.")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sft: SFTConfig = Field(
        default_factory=SFTConfig,
        description="Supervised warm start on demonstrations before RL (off by default).",
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(
        default_factory=EvalConfig,
        description="Held-out evaluation before training, after SFT (if any) and after RL.",
    )
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig,
        description="Ray cluster, node addresses, engine placement, Slurm job (`vime slurm`).",
    )

    @model_validator(mode="before")
    @classmethod
    def _derive_engine_backend(cls, data: Any) -> Any:
        """The engines run the backend named by weight_sync.transport; nobody writes it twice."""
        if not isinstance(data, dict) or "engine" not in data:
            return data
        sync = data.get("weight_sync") or {}
        transport = sync.transport if isinstance(sync, WeightSyncConfig) else sync.get("transport")
        kind = getattr(transport, "kind", None) or (
            transport.get("kind") if isinstance(transport, dict) else transport
        )
        kind = kind or "gloo"
        engine = data["engine"]
        if isinstance(engine, EngineConfig):
            if engine.weight_transfer_backend not in (None, kind):
                raise ValueError(
                    f"engine.weight_transfer_backend={engine.weight_transfer_backend!r} but "
                    f"weight_sync.transport is {kind!r}: leave the engine's unset, the transport "
                    "sets it"
                )
            engine = engine.model_copy(update={"weight_transfer_backend": kind})
        elif isinstance(engine, dict):
            if "weight_transfer_backend" in engine:
                raise ValueError(
                    "engine.weight_transfer_backend is no longer written in a job config: "
                    f"weight_sync.transport (here {kind!r}) sets the engines' backend; remove it"
                )
            engine = {**engine, "weight_transfer_backend": kind}
        return {**data, "engine": engine}

    @model_validator(mode="after")
    def _check_combination(self) -> TrainConfig:
        if self.engine.num_nodes > 1 and not self.engine.external_urls:
            raise ValueError(
                f"engine.num_nodes={self.engine.num_nodes}: the RL job launches each engine on "
                "one node (Ray places one bundle per engine); start an engine spanning nodes "
                "yourself (vime.rollout.server.launch_server with EngineNodeRole) and give its "
                "URL in engine.external_urls, or set engine.num_nodes=1"
            )
        if self.eval.prompts_path and self.eval.timeout_s >= self.weight_sync.barrier_timeout_s:
            raise ValueError(
                f"eval.timeout_s={self.eval.timeout_s:g} must be below "
                f"weight_sync.barrier_timeout_s={self.weight_sync.barrier_timeout_s:g}: the other "
                "trainer ranks wait at a barrier while rank 0 evaluates; lower the first or raise "
                "the second"
            )
        if self.engine.fault_tolerance and self.engine.external_urls:
            raise ValueError(
                "engine.fault_tolerance=true restarts failed engines, which vime cannot do for "
                "engine.external_urls: launch the engines from the job or turn it off"
            )
        return self


ABORT_EXIT_CODE = 3


class _Abort:
    """Ends this rank at once, from any thread (a dead or stalled engine, a dead launcher): names
    why on stderr and in run_dir/failure.json, kills the engine actors this rank owns (their
    keepers end the servers) and exits with ABORT_EXIT_CODE; torchrun then ends the other ranks.
    The main thread may be blocked in a call that never returns, so nothing waits for it."""

    def __init__(self) -> None:
        self.run_dir: Path | None = None
        self.engines: list[Any] = []
        self._once = threading.Lock()

    def __call__(self, message: str) -> None:
        if not self._once.acquire(blocking=False):
            return
        logger.error("aborting the job: %s", message)
        print(f"vime.train: {message}", file=sys.stderr, flush=True)
        if self.run_dir is not None:
            failure = {
                "error": message,
                "rank": int(os.environ.get("RANK", "0")),
                "time": time.time(),
            }
            (self.run_dir / "failure.json").write_text(json.dumps(failure, indent=2))
        for engine in self.engines:
            try:
                engine.kill()
            except Exception as exc:  # noqa: BLE001 (best effort: the keepers end them anyway)
                logger.warning("could not kill %s: %s", engine, exc)
        logging.shutdown()
        os._exit(ABORT_EXIT_CODE)


abort = _Abort()


def _broadcast_object(obj: Any, group: Any) -> Any:
    holder = [obj]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def run(config: TrainConfig) -> dict[str, Any]:
    """Run the job on this rank; rank 0 returns the summary figures (others: {})."""
    from megatron.core import parallel_state

    from vime.megatron.model import initialize_model_parallel
    from vime.trainer import MegatronTrainer

    # One node address for every process of this node (engines launched here, gloo groups,
    # stores): they all read VIME_HOST_IP.
    address = node_address(config.cluster.node_address, config.cluster.interface)
    os.environ[HOST_IP_ENV] = address
    rank, world_size = init_process_group(timedelta(seconds=config.weight_sync.barrier_timeout_s))
    run_dir = Path(config.run_dir)
    sync_group = dist.new_group(
        backend="gloo", timeout=timedelta(seconds=config.weight_sync.barrier_timeout_s)
    )
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        # Without the derived engine backend, so that the file loads back as a config.
        resolved = config.model_dump_json(indent=2, exclude={"engine": {"weight_transfer_backend"}})
        (run_dir / "config.resolved.json").write_text(resolved)
        if config.model.preset is not None:
            from vime.testing.tiny_model import build_tiny_model

            build_tiny_model(
                config.engine.model_path, config.model.preset, config.model.dtype, config.model.seed
            )
    dist.barrier(group=sync_group)

    topology = initialize_model_parallel(
        tp=config.trainer.tensor_parallel_size,
        pp=config.trainer.pipeline_parallel_size,
        timeout=timedelta(seconds=config.trainer.collective_timeout_s),
    )
    dp_group = parallel_state.get_data_parallel_group() if topology.dp_size > 1 else None
    trainer = MegatronTrainer(
        config.trainer,
        model_path=config.engine.model_path,
        topology=topology,
        grpo=config.grpo,
        dp_group=dp_group,
    )
    resumed = None
    resume_path = _resume_path(config, run_dir, rank, sync_group)
    if resume_path is not None:
        # Before any engine starts: a checkpoint that does not fit fails here, fast.
        resumed = load_checkpoint(trainer, resume_path)
        _reapply_optimizer_settings(trainer, config.trainer)

    engines = None
    completed = False
    try:
        engines = RolloutEngines.start(
            config.engine,
            weight_sync=config.weight_sync,
            cluster=config.cluster,
            group=sync_group,
            log_dir=run_dir / "engines",
        )
        abort.run_dir, abort.engines = (run_dir, engines.handles) if rank == 0 else (None, [])
        if rank == 0:
            (run_dir / "engines.json").write_text(json.dumps(engines.describe(), indent=2))
        summary = _run_loop(
            config,
            rank=rank,
            run_dir=run_dir,
            trainer=trainer,
            topology=topology,
            engines=engines,
            resumed=resumed,
        )
        completed = True
    except Exception as exc:
        if rank == 0:
            # Fail fast, as for a dead engine: an orderly shutdown (engines, then Ray draining)
            # takes tens of seconds; the keepers end the engines and Ray once this rank is gone.
            logger.exception("the job failed")
            abort(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if engines is not None:
            # Servers run in their own process groups: end them even when the loop failed.
            engines.shutdown()
        if completed:
            dist.barrier(group=sync_group)
        dist.destroy_process_group()
    return summary


def _resume_path(config: TrainConfig, run_dir: Path, rank: int, group: Any) -> Path | None:
    """Rank 0 picks the checkpoint to resume from and tells every rank (all load it, or none)."""
    choice: tuple[str | None, str | None] = (None, None)  # (path, error)
    if rank == 0:
        try:
            path = config.checkpoint.resume_path(run_dir)
            choice = (str(path) if path else None, None)
            if path is None and config.checkpoint.resume is True:
                logger.info(
                    "checkpoint.resume: no complete checkpoint in %s, starting fresh",
                    config.checkpoint.root(run_dir),
                )
        except ValueError as exc:
            choice = (None, str(exc))
    path, error = _broadcast_object(choice, group)
    if error is not None:
        raise ValueError(error)
    return Path(path) if path else None


def _reapply_optimizer_settings(trainer: Any, config: TrainerConfig) -> None:
    """This job's lr, betas and weight decay, not the checkpoint's (a resume may change them)."""
    for group in trainer.optimizer.param_groups:
        group.update(lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def _run_loop(
    config: TrainConfig,
    *,
    rank: int,
    run_dir: Path,
    trainer: Any,
    topology: Any,
    engines: RolloutEngines,
    resumed: TrainingState | None,
) -> dict:
    """Attach, connect the updater, then generate/train/sync for num_steps; rank 0's summary.

    `resumed`: the TrainingState of the checkpoint the trainer was loaded from, or None. The
    engines are then synced to those weights (as its weight version) before the first rollout,
    and the loop continues at its next step."""
    from transformers import AutoTokenizer

    from vime.rl.rollout import RolloutThread

    sync_group = engines.group
    cpu_cores = config.trainer.resolve_cpu_cores(engines.num_local())
    if cpu_cores and not torch.cuda.is_available():
        # After the engines started (they inherit nothing from here any more): train on the
        # cores the engines leave free, so overlapped generation and training do not contend.
        os.sched_setaffinity(0, set(cpu_cores))
        torch.set_num_threads(len(cpu_cores))
        logger.info("trainer pinned to cores %s", cpu_cores)
    updater = WeightSync(
        trainer.model,
        hf_path=config.engine.model_path,
        engines=engines,
        config=config.weight_sync,
        topology=topology,
    )
    start_step = 0
    if resumed is not None:
        report = updater.update_weights(version=resumed.weight_version)
        logger.info(
            "engines synced to the resumed weights (version %d) in %.2f s; continuing at step %d",
            updater.weight_version,
            report.total_s,
            resumed.next_step,
        )
        start_step = resumed.next_step
        if rank == 0:
            # Rows the killed run wrote for steps it had not checkpointed are written again.
            for name in ("metrics.jsonl", "eval.jsonl", "rollouts.jsonl"):
                drop_rows_from(run_dir / name, start_step)
    checkpoint_root = config.checkpoint.root(run_dir)

    tokenizer = AutoTokenizer.from_pretrained(config.engine.model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rollouts = None
    writer = None
    watchdog = None
    recovery = None
    fault_tolerant = config.engine.fault_tolerance
    urls = engines.urls
    if rank == 0:
        client = engines.client(fault_tolerant=fault_tolerant)
        rollouts = RolloutThread(config.rollout, client=client, tokenizer=tokenizer)
        writer = MetricsWriter(run_dir, resume=resumed is not None)
        if fault_tolerant:
            from vime.rollout.ray_engine import startup_bound

            recovery = EngineRecovery(engines.handles, client, startup_bound(config.engine))
        watchdog = EngineWatchdog(
            urls,
            recovery.on_failure if recovery else (lambda failure: abort(str(failure))),
            token=engines.token,
            interval_s=config.engine.watchdog_interval_s,
            progress_timeout_s=config.engine.progress_timeout_s,
        ).start()
        if recovery:
            recovery.watchdog = watchdog
    recover = _Recover(updater, recovery, sync_group, config.engine.progress_timeout_s)
    summary: dict[str, Any] = {}
    evaluations: dict[str, Any] = {}  # "before"/"after": scores; "after_error": why not

    def evaluate(when: str, step: int) -> None:
        """Rank 0: greedy pass@1 on the held-out prompts through the engines, as they are now.
        `when`: before (the initial model), resumed (a resumed job's checkpoint), after_sft,
        after (RL)."""
        if rollouts is None or writer is None or config.eval.prompts_path is None:
            return
        future = rollouts.evaluate(config.eval.rollout_config(config.rollout))
        try:
            scores = eval_metrics(future.result(timeout=config.eval.timeout_s))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"held-out eval {when} step {step} took over eval.timeout_s="
                f"{config.eval.timeout_s:g} s (raise it, or use fewer eval prompts)"
            ) from None
        scores["eval/weight_version"] = float(updater.weight_version)
        writer.log_eval(step, scores, stage=when)
        evaluations[when] = scores
        logger.info("held-out eval %s step %d: pass@1 %.3f", when, step, scores["eval/pass_at_1"])

    job_start = time.time()
    try:
        evaluate("before" if resumed is None else "resumed", start_step)
        if config.sft.enabled and resumed is None:
            sft = _supervised_stage(config, trainer, tokenizer, run_dir, rank)
            if rank == 0:
                summary["sft"] = sft
            report = recover.sync()
            logger.info(
                "engines synced to the SFT weights (version %d) in %.2f s",
                updater.weight_version,
                report.total_s,
            )
            evaluate("after_sft", start_step)
        pending = None
        if rollouts is not None and config.loop == "async" and start_step < config.num_steps:
            pending = rollouts.submit(start_step)
        for step in range(start_step, config.num_steps):
            batch = None
            if rollouts is not None and pending is None:
                pending = rollouts.submit(step)
            # Rank 0 sends the batch, or first (fault tolerance) the engines to recover.
            batch = recover.until_batch(pending)
            if rollouts is not None:  # rank 0
                # One-off pipelining: batch k+1 is generated while batch k trains and syncs.
                is_last = step + 1 == config.num_steps
                pending = (
                    rollouts.submit(step + 1) if config.loop == "async" and not is_last else None
                )
            if rank == 0 and config.save_rollouts:
                batch.write_jsonl(run_dir / "rollouts.jsonl", updater.weight_version)
            packed = _broadcast_object(batch.pack(pad_id) if rank == 0 else None, sync_group)
            train_start = time.time()
            train_metrics = trainer.train_step(packed, weight_version=updater.weight_version)
            train_end = time.time()
            report = recover.sync()
            if writer is not None:  # rank 0
                metrics = {
                    **batch.metrics(trainer_version=updater.weight_version - 1),
                    **prefixed(train_metrics, "train/"),
                    "rollout/num_samples": len(batch.samples),
                    "sync/time_s": report.total_s,
                    "sync/weight_version": updater.weight_version,
                    "sync/verified": float(report.verified),
                    "sync/bytes": report.num_bytes,
                    "train/param_fingerprint": trainer.param_fingerprint(),
                    "time/gen_start": batch.start_time - job_start,
                    "time/gen_end": batch.end_time - job_start,
                    "time/train_start": train_start - job_start,
                    "time/train_end": train_end - job_start,
                    "time/step_end": time.time() - job_start,
                }
                metrics.update(prefixed(report.seconds, "sync/phase_"))
                if recovery is not None:
                    metrics.update(recovery.metrics())
                writer.log(step, metrics)
                logger.info(
                    "step %d: reward %.3f, logprob diff %.4f, sync %.2f s, version %d",
                    step,
                    metrics.get("rollout/reward_mean", float("nan")),
                    train_metrics.get("logprob_diff", float("nan")),
                    report.total_s,
                    updater.weight_version,
                )
            if config.checkpoint.due(step + 1, config.num_steps):
                state = TrainingState(next_step=step + 1, weight_version=updater.weight_version)
                save_checkpoint(trainer, checkpoint_root, state, keep=config.checkpoint.keep)
        try:
            evaluate("after", config.num_steps)
        except Exception as exc:  # noqa: BLE001 (training and its checkpoint are done: report it)
            logger.error("held-out eval after training failed: %s", exc)
            evaluations["after_error"] = str(exc)
    finally:
        if watchdog is not None:
            watchdog.stop()  # before the engines end on purpose
        if recovery is not None:
            recovery.close()
        if rollouts is not None and writer is not None:  # rank 0
            rollouts.close()
            writer.close()
            summary = {
                **summary,
                "wall_s": time.time() - job_start,
                **(
                    {"engine_restarts": recovery.num_restarts, "recovery_s": recovery.recovery_s}
                    if recovery
                    else {}
                ),
                "run_dir": str(run_dir),
                **({"eval": evaluations} if evaluations else {}),
                # Where rank 0 ran (engines.json says where each engine ran).
                "trainer_node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
                "trainer_address": os.environ[HOST_IP_ENV],
                "world_size": dist.get_world_size(),
            }
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        updater.close()
    return summary


def _supervised_stage(
    config: TrainConfig, trainer: Any, tokenizer: Any, run_dir: Path, rank: int
) -> dict[str, float]:
    """Every rank: `sft.num_steps` supervised steps (rank 0 writes run_dir/sft.jsonl), then
    the trainer starts RL from these weights. Returns the first and last steps' loss."""
    records = load_demonstrations(str(config.sft.data_path))
    trainer.start_sft(config.sft.lr)
    started = time.time()
    rows = []
    for step in range(config.sft.num_steps):
        input_ids, loss_mask = sft_batch(records, step, config.sft, tokenizer)
        metrics = trainer.sft_step(input_ids, loss_mask)
        rows.append({"step": step, **prefixed(metrics, "sft/")})
        if step % 10 == 0 or step + 1 == config.sft.num_steps:
            logger.info(
                "sft step %d: loss %.4f, confident %.3f",
                step,
                metrics["loss"],
                metrics["confident_fraction"],
            )
    trainer.start_rl()
    if rank == 0:
        (run_dir / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "sft/num_steps": float(config.sft.num_steps),
        "sft/loss_first": rows[0]["sft/loss"],
        "sft/loss_last": rows[-1]["sft/loss"],
        "sft/wall_s": time.time() - started,
    }


class _Recover:
    """The training loop's safe points for engine fault tolerance (vime.rollout.recovery).

    Every rank calls the same methods in the same order; rank 0 decides and broadcasts. Without
    fault tolerance they only wait for the batch and sync.
    """

    def __init__(self, updater, recovery, group, failure_wait_s: float) -> None:
        self.updater = updater
        self.recovery = recovery  # rank 0 with fault tolerance, else None
        self.group = group
        self.failure_wait_s = failure_wait_s
        self.enabled = _broadcast_object(recovery is not None, group)

    def until_batch(self, pending):
        """Rank 0: the batch, once generated (None on other ranks); engines that fail meanwhile
        are recovered first, on every rank."""
        while True:
            down: list[int] = []
            batch = None
            if self.recovery is not None:
                while not (down := self.recovery.pending()):
                    try:
                        batch = pending.result(timeout=0.5)
                        break
                    except concurrent.futures.TimeoutError:
                        continue
            elif pending is not None:
                batch = pending.result()
            if self.enabled:
                down = _broadcast_object(down, self.group)
            if not down:
                return batch
            self._recover(down, resync=True)

    def sync(self):
        """updater.update_weights(); with fault tolerance a sync that fails because an engine
        failed is retried (the same version) once the engine is back."""
        recovered: list[int] = []
        while True:
            try:
                report = self.updater.update_weights()
            except WeightSyncError:
                if not self.enabled:
                    raise
                down = self.recovery.wait_for_failure(self.failure_wait_s) if self.recovery else []
                down = _broadcast_object(down, self.group)
                if not down:
                    raise
                # The failed version is not taken: the retry sends the same version number.
                self._recover(down, resync=False)
                recovered += down
                continue
            if recovered and self.recovery is not None:
                self.recovery.restored(recovered)  # the retried sync reached them
            return report

    def _recover(self, down: list[int], *, resync: bool) -> None:
        """Every rank: wait for the restarts (rank 0), reconnect the updater to every engine and,
        if `resync`, push the trainer's current weights (same version) into every engine."""
        logger.warning("recovering engines %s", down)
        if self.recovery is not None:
            self.recovery.wait_restarted(down)
        dist.barrier(group=self.group)
        self.updater.reconnect()
        if resync:
            self.updater.resync()
            if self.recovery is not None:
                self.recovery.restored(down)
        logger.warning("engines %s reconnected%s", down, " and synced" if resync else "")


def check_checkpoint(config: TrainConfig) -> None:
    """The trainer and the tokenizer read engine.model_path: it must be an HF checkpoint directory,
    unless model.preset builds one there."""
    path = Path(config.engine.model_path)
    if config.model.preset is None and not (path / "config.json").is_file():
        what = "has no config.json" if path.is_dir() else "does not exist"
        raise ValueError(
            f"engine.model_path={config.engine.model_path!r} {what}: give the directory of an HF "
            "checkpoint (config.json, safetensors, tokenizer), or set model.preset to build a "
            "tiny one there"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file under configs/")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. num_steps=5")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s"
    )
    try:
        config = load_config(TrainConfig, args.config, args.overrides)
        check_checkpoint(config)
    except (ValueError, OSError) as exc:
        # Fail before any process group, engine or model exists; the message names each field.
        print(f"vime.train: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # torchrun SIGKILLed would leave this rank running on, unattended.
    watch_parent(abort)
    summary = run(config)
    if summary:
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
