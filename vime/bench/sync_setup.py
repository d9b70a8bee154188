"""`vime bench-sync`'s set-up: cores for the trainer and the engine, one running engine per
transport, and the trainer ranks' model.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("vime.bench")


@functools.cache
def all_cores() -> frozenset[int]:
    """The cores this process may use, read once, before any pinning (`main` asks first)."""
    return frozenset(os.sched_getaffinity(0))


# ---- engines -------------------------------------------------------------------------------------


def split_cores() -> tuple[list[int], list[int]]:
    """(engine cores, trainer cores): the trainer gets the last core, as in the RL job.

    vLLM's OpenMP threads spin after each kernel; a trainer whose threads share their core runs
    several times slower (see TrainerConfig.cpu_cores). All engines share the other cores: only
    one of them works at a time here.
    """
    cores = sorted(all_cores())
    if len(cores) < 2:
        return cores, cores
    return cores[:-1], cores[-1:]


def engine_cpu_binding(tensor_parallel_size: int = 1) -> dict[str, str]:
    """The engine's cores, split between its workers (`|`-separated lists, one per worker).

    With fewer engine cores than workers each worker gets one core of all of them, round robin:
    the workers then share cores with each other and the trainer (say so next to any figure).
    """
    if torch.cuda.is_available():
        return {}
    engine_cores, _ = split_cores()
    if len(engine_cores) < tensor_parallel_size:
        cores = sorted(all_cores())
        lists = [[cores[worker % len(cores)]] for worker in range(tensor_parallel_size)]
    else:
        per_worker = len(engine_cores) // tensor_parallel_size
        lists = [
            engine_cores[worker * per_worker : (worker + 1) * per_worker]
            for worker in range(tensor_parallel_size)
        ]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, c)) for c in lists)}


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-env takes KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def build_bench_model(model_dir: Path, preset: str, dtype: str) -> Path:
    """The benchmark's checkpoint: a real pretrained one (`vime.pretrained`, e.g.
    smollm2-135m-instruct) or a random one of a tiny_model preset's shape."""
    from vime.pretrained import PRETRAINED, build_pretrained
    from vime.testing.tiny_model import build_tiny_model

    if preset in PRETRAINED:
        return build_pretrained(preset, model_dir, dtype)
    return build_tiny_model(model_dir, preset, dtype)


def training_batch(model_dir: Path, vocab_size: int, step: int, length: int = 65) -> torch.Tensor:
    """Two sequences of `length` token ids for a benchmark's optimizer step: real text for a
    pretrained checkpoint (the small-addition task's prompts and answers in its chat template),
    random ids for a random one."""
    generator = torch.Generator().manual_seed(step)
    if not (model_dir / "vime_pretrained.json").exists():
        return torch.randint(0, vocab_size, (2, length), generator=generator)
    from transformers import AutoTokenizer

    from vime.rl.data import load_prompts, resolve_data_path

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = load_prompts(resolve_data_path("add_small/train.jsonl"))
    rows = []
    for index in torch.randint(0, len(records), (2,), generator=generator).tolist():
        record = records[index]
        chat = [
            {"role": "user", "content": record.prompt},
            {"role": "assistant", "content": str(record.metadata["answer"])},
        ]
        ids = tokenizer.apply_chat_template(chat, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        rows.append((ids * (length // len(ids) + 1))[:length])  # repeated to the length
    return torch.tensor(rows)


def pin_trainer() -> list[int]:
    """Pin this process (and torch's threads) to the trainer's cores; returns them."""
    _, trainer_cores = split_cores()
    os.sched_setaffinity(0, trainer_cores)
    torch.set_num_threads(len(trainer_cores))
    return trainer_cores


def unpin() -> None:
    """Every core again (engines launched from here inherit this process's affinity)."""
    os.sched_setaffinity(0, all_cores())
    torch.set_num_threads(len(all_cores()))


@contextmanager
def running_engine(
    args: argparse.Namespace, model_dir: Path, dtype: str, transport: str, name: str = ""
) -> Iterator[Any]:
    """One vLLM engine serving `transport`'s backend, launched by rank 0 and ended on exit.

    Engines run one at a time: two 0.5B fp32 engines next to the trainer do not fit in 24 GiB.
    They start unpinned (they inherit this process's affinity) on the cores the trainer leaves.
    """
    from vime.config import EngineConfig
    from vime.engines.vllm_engine import VLLMEngine

    rank = dist.get_rank()
    config = EngineConfig(
        model_path=str(model_dir),
        dtype=dtype,
        max_model_len=512,
        max_num_seqs=8,
        weight_transfer_backend=transport,
        tensor_parallel_size=args.engine_tp,
        request_timeout_s=900,
        startup_timeout_s=900,
        extra_env={**engine_cpu_binding(args.engine_tp), **parse_env(args.engine_env)},
        cpu_reuse_freed_memory=args.engine_malloc == "reuse",
        cpu_sync_load_cores=args.engine_load_cores,
    )
    engine = None
    url: list[str | None] = [None]
    unpin()
    attached = getattr(args, "engine_urls", {}).get(transport)
    if attached is not None:  # a running engine (--engine-url): attached on every rank, kept
        config = config.model_copy(update={"auth_token": os.environ.get("VIME_ENGINE_TOKEN")})
        engine = VLLMEngine(config, url=attached)
        engine.init()
        yield engine
        return
    try:
        if rank == 0:
            log_dir = Path(args.out) / "engines" / f"{dtype}-{transport}{name}"
            engine = VLLMEngine(config, log_dir=str(log_dir))
            try:
                url[0] = engine.init()
            finally:
                dist.broadcast_object_list(url, src=0)  # None tells the others it failed
        else:
            dist.broadcast_object_list(url, src=0)
            if url[0] is None:
                raise RuntimeError(f"rank 0 could not start the {transport} engine")
            engine = VLLMEngine(config, url=url[0])
            engine.init()
        yield engine
    finally:
        if rank == 0 and engine is not None:
            engine.shutdown()


# ---- the trainer side ------------------------------------------------------------------------


@dataclass
class Trainer:
    model: torch.nn.Module
    converter: Any
    topology: Any
    groups: Any
    sync_group: Any

    def flip_weights(self) -> None:
        """New bytes for the next sync: every weight changes sign (exactly)."""
        with torch.no_grad():
            for param in self.model.parameters():
                param.neg_()

    def updater(
        self,
        transport: str | dict[str, Any],
        engine: Any,
        bucket_bytes: int,
        version: int,
        verify_checksums: bool = False,
        shadow: bool = False,
        ahead: bool = True,
    ) -> Any:
        """A connected WeightUpdater from this trainer into `engine` (or a list of them)."""
        from vime.config import WeightSyncConfig
        from vime.weight_sync.updater import WeightUpdater

        config = WeightSyncConfig(
            transport=transport,
            update_weight_buffer_size=bucket_bytes,
            verify_checksums=verify_checksums,
            shadow=shadow,
            pack_before_pause=ahead,
            transfer_timeout_s=900,
            barrier_timeout_s=900,
        )
        updater = WeightUpdater(
            config=config,
            engines=engine if isinstance(engine, list) else [engine],
            model=self.model,
            converter=self.converter,
            topology=self.topology,
            gather_groups=self.groups,
            sync_group=self.sync_group,
            weight_version=version,
        )
        updater.connect()
        return updater


def build_trainer(model_dir: Path, dtype: str, topology: Any, sync_group: Any) -> Trainer:
    from vime.megatron.gather import GatherGroups
    from vime.megatron.model import (
        build_from_hf,
    )

    model, converter = build_from_hf(model_dir, topology, params_dtype=getattr(torch, dtype))
    return Trainer(model, converter, topology, GatherGroups.from_parallel_state(), sync_group)
