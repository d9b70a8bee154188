"""Trainer ranks for the weight-sync tests: real megatron-core on gloo, syncing into vLLM servers.

`run_sync_job(job, world_size, out_dir)` spawns the ranks. Each builds the model from an HF
checkpoint and then, per `SyncStep`: takes a real SGD step (a deterministic perturbation of every
parameter), syncs into the step's engines with the step's transport, exports the same
weights through a separate gather (pp senders write them to out_dir), and on rank 0 records what
the engines serve (checksums, greedy tokens, weight version, an in-flight request's tokens).
The test process asserts on those files.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import requests
import torch
from engine_token import HEADERS, TOKEN
from megatron_harness import init_gloo_rank, spawn_ranks

from vime.testing.hf import hf_greedy, hf_greedy_across_switch
from vime.weight_sync.devices.base import TRAINER_DEVICE_ENV

COLLECTIVE_TIMEOUT = timedelta(seconds=90)
SWITCH_CHECK_TOKENS = 48  # continuation tokens compared with HF after a clear_cache switch
GREEDY_TOKENS = 12
PROMPT_IDS = (11, 22, 33, 44, 55)
INFLIGHT_TOKENS = 2000  # the most max_model_len 2048 allows: the pause lands mid-request


@dataclass(frozen=True)
class SyncStep:
    # gloo | nccl (broadcast) | shm | ipc (colocated); nccl and ipc run with device: cpu, their
    # CPU plug-ins: the same transport and receiver code as on a GPU.
    transport: str
    engine_urls: tuple[str, ...]
    version: int  # the engines serve str(version) after the step
    clear_cache: bool = False
    inflight: bool = False  # a greedy request runs across the sync
    model_dtype: str | None = None  # another model (e.g. a mismatch); None: the job's model
    model_dir: str | None = None
    expect_error: bool = False  # connect() must raise; nothing is synced
    # The last stage's model gets a parameter no converter maps, for this step only.
    extra_param: bool = False
    delta: bool = False  # weight_sync.transport.delta
    shadow: bool = False  # weight_sync.shadow: the engines load beside the served weights
    # With shadow: once the engine has the update loaded beside its served weights, before the
    # swap, rank 0 records what it serves then (record["staged"]: greedy output, digests).
    probe_staged: bool = False
    changed_fraction: float = 1.0  # of every parameter's elements the step's SGD changes
    reconnect: bool = False  # the updater reconnects first (as after an engine restart)
    reset_delta: bool = False  # a full sync over the same transport (more buckets than a delta)
    fail_in_send: bool = False  # the pp sender of the last stage raises after its first bucket
    kill_in_send: bool = False  # ... or kills itself (SIGKILL) there: the job dies mid-sync
    bucket_bytes: int = 200_000


@dataclass(frozen=True)
class SyncJob:
    model_dir: str
    dtype: str = "float32"
    tp: int = 1
    pp: int = 1
    # Each rank stands on its own CPU stand-in device "cpu:<rank>" (VIME_DEVICE_ID), as trainer
    # ranks on GPUs would; unset: every rank on the shared host ("cpu").
    device_ids: bool = False
    steps: tuple[SyncStep, ...] = field(default=())


def perturb(model, topology, optimizer, step: int, fraction: float = 1.0) -> None:
    """One real SGD step on a loss whose gradient is a fixed random tensor per parameter, zero
    outside a random `fraction` of its elements (so only those change).

    Replicated parameters get the same gradient on every TP rank; TP shards get their own.
    """
    from vime.megatron.model import full_param_names

    names = full_param_names(model, topology)
    optimizer.zero_grad()
    loss = torch.zeros(())
    for local_name, param in model.named_parameters():
        shard = topology.tp_rank if getattr(param, "tensor_model_parallel", False) else 0
        seed = zlib.crc32(f"{names[local_name]}|{shard}|{step}".encode())
        generator = torch.Generator().manual_seed(seed)
        direction = torch.randn(param.shape, generator=generator)
        if fraction < 1.0:
            direction *= torch.rand(param.shape, generator=generator) < fraction
        loss = loss + (param.float() * direction).sum()
    loss.backward()
    optimizer.step()


def completions_greedy(url: str, prompt_ids, max_tokens: int = GREEDY_TOKENS) -> list[int]:
    body = {
        "model": requests.get(f"{url}/v1/models", timeout=30, headers=HEADERS).json()["data"][0][
            "id"
        ],
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = requests.post(f"{url}/v1/completions", json=body, timeout=120, headers=HEADERS)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


class InflightRequest:
    """A greedy streamed request on its own thread and event loop."""

    def __init__(self, url: str):
        from vime.engines.generate_api import SamplingConfig
        from vime.engines.generation import GenerationClient

        self.result = None
        self.error: BaseException | None = None

        async def generate() -> None:
            async with GenerationClient([url], token=TOKEN, timeout_s=300) as client:
                sampling = SamplingConfig(
                    max_tokens=INFLIGHT_TOKENS, temperature=0.0, ignore_eos=True
                )
                self.result = await client.generate(PROMPT_IDS, sampling)

        def run() -> None:
            try:
                asyncio.run(generate())
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout_s: float = 300):
        self.thread.join(timeout_s)
        if self.error is not None:
            raise self.error
        assert self.result is not None, "in-flight request did not finish"
        return self.result


def _start_frozen_request(gate, deadline_s: float = 240) -> InflightRequest:
    """A greedy request frozen mid-generation by a keep pause the test holds (`gate`, the step's
    engine): the sync's own keep pause finds the engine paused (idempotent) and its resume
    releases the request on the new weights, however slow the sync is on a loaded machine.

    The engine is paused right after the request is sent, without waiting for its stream: on a
    loaded machine the client can see the first tokens only after the engine made all of them
    (CI saw three 2000-token requests end that way). A pause that lands before the engine took
    the request holds it unscheduled: resume and pause again until it is frozen holding KV blocks
    (the engine's refusal to reset its prefix cache proves it), i.e. after its prefill, with at
    least one token made on the old weights. A request that ended anyway (the pause was starved
    for its whole run) is let go and another one gated.
    """
    gate.init()
    deadline = time.monotonic() + deadline_s
    requests_sent = 0
    while time.monotonic() < deadline:
        inflight = InflightRequest(gate.url)
        requests_sent += 1
        while time.monotonic() < deadline:
            gate.pause_generation(mode="keep", clear_cache=False)
            if not gate.flush_cache(timeout_s=0.0, raise_on_timeout=False):
                return inflight  # it holds KV blocks: frozen mid-generation
            gate.continue_generation()  # not taken yet, or already ended
            if not inflight.thread.is_alive():
                inflight.join()  # it ended before any pause landed: gate another
                break
    raise AssertionError(
        f"no request was frozen mid-generation in {deadline_s:g} s ({requests_sent} sent): "
        "every one ended before a keep pause landed"
    )


def _worker(rank: int, world_size: int, port: int, job: SyncJob, out_dir: str) -> None:
    try:
        _run(rank, world_size, port, job, Path(out_dir))
    except BaseException:
        (Path(out_dir) / f"rank{rank}-error.txt").write_text(traceback.format_exc())
        raise


def _run(rank: int, world_size: int, port: int, job: SyncJob, out_dir: Path) -> None:
    import logging

    import torch.distributed as dist

    from vime.config import EngineConfig, WeightSyncConfig
    from vime.engines.vllm_engine import VLLMEngine
    from vime.megatron.gather import GatherGroups, gather_hf_weights
    from vime.megatron.model import (
        build_from_hf,
        initialize_model_parallel,
    )
    from vime.weight_sync.updater import WeightUpdater

    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
    if job.device_ids:
        os.environ[TRAINER_DEVICE_ENV] = str(rank)
    init_gloo_rank(rank, world_size, port)
    topology = initialize_model_parallel(tp=job.tp, pp=job.pp, timeout=COLLECTIVE_TIMEOUT)
    groups = GatherGroups.from_parallel_state()
    sync_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)

    models = {}

    def model_for(model_dir: str, dtype: str):
        if (model_dir, dtype) not in models:
            model, converter = build_from_hf(
                model_dir, topology, params_dtype=getattr(torch, dtype), vocab_divisible_by=96
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            models[model_dir, dtype] = (model, converter, optimizer)
        return models[model_dir, dtype]

    updaters = {}
    for index, step in enumerate(job.steps):
        model_dir = step.model_dir or job.model_dir
        model, converter, optimizer = model_for(model_dir, step.model_dtype or job.dtype)
        record: dict = {"step": step}
        if not step.expect_error:
            perturb(model, topology, optimizer, index, step.changed_fraction)
        engine_config = EngineConfig(model_path=model_dir, request_timeout_s=60, auth_token=TOKEN)
        dtype = step.model_dtype or job.dtype
        key = (
            step.transport,
            step.engine_urls,
            step.clear_cache,
            model_dir,
            dtype,
            step.delta,
            step.shadow,
        )
        extra = None
        if step.extra_param and topology.pp_rank == topology.pp_size - 1:
            extra = model.decoder.layers[-1].mlp
            extra.register_parameter("extra_scale", torch.nn.Parameter(torch.ones(4)))
        if key not in updaters or step.expect_error:
            engines = []
            for url in step.engine_urls:
                engine = VLLMEngine(engine_config, url=url)
                engine.init()
                engines.append(engine)
            config = WeightSyncConfig(
                transport={
                    "kind": step.transport,
                    "delta": step.delta,
                    **({"device": "cpu"} if step.transport in ("nccl", "ipc") else {}),
                },
                update_weight_buffer_size=step.bucket_bytes,
                clear_cache_on_pause=step.clear_cache,
                shadow=step.shadow,
                verify_checksums=True,
                barrier_timeout_s=60,
                transfer_timeout_s=60,
            )
            updater = WeightUpdater(
                config=config,
                engines=engines,
                model=model,
                converter=converter,
                topology=topology,
                gather_groups=groups,
                sync_group=sync_group,
            )
            if step.expect_error:
                started = time.monotonic()
                try:
                    updater.connect()
                except ValueError as exc:
                    record["error"] = str(exc)
                record["error_s"] = time.monotonic() - started
                if extra is not None:
                    del extra._parameters["extra_scale"]
                _record_engines(rank, record, engines, out_dir, index)
                dist.barrier()
                continue
            updater.connect()
            updaters[key] = updater
        updater = updaters[key]
        if step.reconnect:
            updater.close()
            updater.connect()
        if step.reset_delta:
            updater.reset_delta()
        last_sender = updater.is_sender and topology.pp_rank == topology.pp_size - 1
        if (step.fail_in_send or step.kill_in_send) and last_sender:
            _break_after_first_bucket(updater, kill=step.kill_in_send)
        if rank == 0 and step.probe_staged:
            _probe_when_staged(record)
        inflight = None
        if rank == 0 and step.inflight:
            gate = VLLMEngine(engine_config, url=step.engine_urls[0])
            inflight = _start_frozen_request(gate)
            if step.shadow:
                _release_after_the_commit(gate)
        try:
            record["report"] = updater.update_weights(version=step.version)
        except Exception as exc:
            if not step.fail_in_send:
                raise
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["error_phase"] = getattr(exc, "phase", None)
        if inflight is not None:
            result = inflight.join()
            record["inflight"] = {
                "token_ids": result.token_ids,
                "weight_versions": result.weight_versions,
                "finish_reason": result.finish_reason,
            }
        # The weights just synced, exported by a separate gather (not through the updater).
        exported = {
            name: tensor.clone()
            for name, tensor in gather_hf_weights(
                model,
                converter=converter,
                topology=topology,
                groups=groups,
                timeout=COLLECTIVE_TIMEOUT,
            )
        }
        if topology.is_pp_sender:
            torch.save(exported, out_dir / f"step{index}-stage{topology.pp_rank}.pt")
        _record_engines(rank, record, updater.engines, out_dir, index)
        dist.barrier()
    for updater in updaters.values():
        updater.close()
    dist.barrier()
    dist.destroy_process_group()


def _break_after_first_bucket(updater, kill: bool = False) -> None:
    transport = updater.transport
    original = transport.send_buckets

    def fail() -> None:
        if kill:  # the engines have bucket 0 and wait for bucket 1 from a dead sender
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("injected failure before sending bucket 1")

    def send_buckets(buckets, fill, update_calls):
        def failing_fill(bucket, buffer):
            if bucket.index >= 1:
                fail()
            fill(bucket, buffer)

        def failing_call(call):
            def post(info):
                if any(bucket["index"] >= 1 for bucket in info["buckets"]):
                    fail()
                return call(info)

            return post

        try:
            if updater.config.fills_ahead:  # packed before the pause: fail in the post instead
                return original(buckets, fill, [failing_call(call) for call in update_calls])
            return original(buckets, failing_fill, update_calls)
        finally:
            transport.send_buckets = original

    transport.send_buckets = send_buckets


def _release_after_the_commit(gate) -> None:
    """For the next sync only (weight_sync.shadow with the engine-core hook, which pauses
    nothing): the request `_start_frozen_request` froze stays frozen, holding its KV blocks,
    until the one-call commit has swapped and labelled; then `gate` resumes it, and it decodes
    on the new weights. Whatever the machine's load, the switch falls inside the request (a
    tiny-model request released before the commit can end before the commit lands)."""
    from vime.weight_sync.engine_control import EngineControl

    original = EngineControl.commit_between_steps

    def commit_then_release(self, version: str) -> bool:
        EngineControl.commit_between_steps = original  # type: ignore[method-assign]
        try:
            return original(self, version)
        finally:
            gate.continue_generation()

    EngineControl.commit_between_steps = commit_then_release  # type: ignore[method-assign]


def _probe_when_staged(record: dict) -> None:
    """For the next sync only: once an engine reports its update ready beside the served
    weights (the session's `wait_staged`), record what it serves before the swap."""
    from vime.weight_sync import engine_control

    original = engine_control.wait_staged

    def wait_then_probe(engine, timeout_s: float) -> None:
        engine_control.wait_staged = original
        original(engine, timeout_s)
        record["staged"] = {
            "metadata": engine.collective_rpc("vime_weight_metadata"),
            "checksums": engine.collective_rpc("vime_weight_checksums"),
            "greedy": completions_greedy(engine.url, PROMPT_IDS),
            "weight_version": engine.get_weight_version(),
            "is_paused": engine.is_paused(),
        }

    engine_control.wait_staged = wait_then_probe


def _record_engines(rank: int, record: dict, engines, out_dir: Path, index: int) -> None:
    if rank != 0:
        return
    record["engines"] = [
        {
            "url": engine.url,
            # Per worker: its metadata (dtype, whole shape, slice held) and its parts' digests.
            "metadata": engine.collective_rpc("vime_weight_metadata"),
            "checksums": engine.collective_rpc("vime_weight_checksums"),
            # The updater's own check (verify_source: loaded): the digests taken at load.
            "loaded_checksums": engine.collective_rpc(
                "vime_weight_checksums", kwargs={"source": "loaded"}
            ),
            "greedy": completions_greedy(engine.url, PROMPT_IDS),
            "update_stats": engine.collective_rpc("vime_weight_update_stats"),
            "weight_version": engine.get_weight_version(),
            "is_paused": engine.is_paused(),
        }
        for engine in engines
    ]
    torch.save(record, out_dir / f"step{index}-record.pt")


def served_differences(engine_record: dict, exported: dict) -> list[str]:
    """Tensors some worker of the engine serves unlike the same slice of `exported`.

    Computed here from the worker's reported slice and dtype (vLLM CPU serves some tensors of a
    bfloat16 model in float32, an exact upcast), independently of the updater's own check.
    """
    from vime.weight_sync.buckets import dtype_from_name, tensor_digest
    from vime.weight_sync.shards import Shard

    differ = []
    covered: dict[str, set[int]] = {}  # name -> indices along the sliced dim some worker holds
    workers = zip(engine_record["metadata"], engine_record["checksums"], strict=True)
    for worker, (metadata, served) in enumerate(workers):
        expected = {}
        for entry in metadata:
            whole = exported[entry["name"]]
            shard = Shard.from_list(entry["shard"])
            part = whole if shard is None else shard.take(whole)
            held = range(whole.shape[0]) if shard is None else range(shard.start, shard.stop)
            if shard is None or shard.dim == 0:
                covered.setdefault(entry["name"], set()).update(held)
            else:
                covered.setdefault(entry["name"], set(range(whole.shape[0])))
                covered.setdefault(f"{entry['name']} dim {shard.dim}", set()).update(held)
            expected[entry["name"]] = tensor_digest(part.to(dtype_from_name(entry["dtype"])))
        assert expected.keys() == exported.keys(), f"worker {worker} serves other tensors"
        differ += [
            f"worker {worker}: {name}"
            for name in expected.keys() | served.keys()
            if expected.get(name) != served.get(name)
        ]
    # Together the workers hold every element: the slices tile each tensor.
    for key, indices in covered.items():
        name, _, dim = key.partition(" dim ")
        size = exported[name].shape[int(dim) if dim else 0]
        if indices != set(range(size)):
            differ.append(f"{key}: the workers' slices cover {len(indices)} of {size}")
    return sorted(differ)


def run_sync_job(job: SyncJob, world_size: int, out_dir: Path, *, timeout_s: float = 240.0):
    """Run the job; return (records per step, exported HF weights per step)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        spawn_ranks(_worker, world_size, (job, str(out_dir)), timeout_s=timeout_s, what=str(job))
    except BaseException:
        errors = "\n".join(p.read_text() for p in sorted(out_dir.glob("rank*-error.txt")))
        raise RuntimeError(f"sync job failed:\n{errors}") from None
    return load_sync_records(out_dir, len(job.steps))


def load_sync_records(out_dir: Path, num_steps: int):
    """(records, exported HF weights) of a sync job's first `num_steps` steps."""
    records, exported = [], []
    for index in range(num_steps):
        records.append(torch.load(out_dir / f"step{index}-record.pt", weights_only=False))
        weights: dict = {}
        for part in sorted(out_dir.glob(f"step{index}-stage*.pt")):
            weights.update(torch.load(part, weights_only=False))
        exported.append(weights)
    return records, exported


class HFReference:
    """HF transformers on exported weights: the tiny model's config with other tensors."""

    def __init__(self, model_dir: str, root: Path):
        self.model_dir = Path(model_dir)
        self.root = root
        self.count = 0

    def load(self, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        from vime.export import write_hf_checkpoint

        self.count += 1
        out = write_hf_checkpoint(weights, self.model_dir, self.root / f"exported-{self.count}")
        return AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()


def assert_synced(record: dict, exported: dict, hf: HFReference, checkpoint: dict) -> None:
    """Every engine of the step serves `exported` exactly and generates like HF on it."""
    step = record["step"]
    assert exported, "no weights exported"
    assert any(not torch.equal(t, checkpoint[name]) for name, t in exported.items()), (
        "the SGD step changed nothing"
    )
    dtype = next(iter(exported.values())).dtype
    reference_tokens = hf_greedy(hf.load(exported, dtype), PROMPT_IDS, GREEDY_TOKENS)
    for engine in record["engines"]:
        differ = served_differences(engine, exported)
        assert not differ, f"{engine['url']} serves tensors unlike the trainer's: {differ}"
        # What the kernels serve (read back through them) is what was recorded at their load.
        assert engine["loaded_checksums"] == engine["checksums"], engine["url"]
        assert engine["greedy"] == reference_tokens, engine["url"]
        assert engine["weight_version"] == str(step.version)
        assert engine["is_paused"] is False
    report = record["report"]
    assert report.weight_version == step.version
    assert report.verified
    assert {"pause", "start", "send", "finish", "verify", "resume"} <= set(report.seconds)


@contextmanager
def running_engines(specs: dict[str, dict], log_dir: str):
    """vLLM CPU engines launched at once, {name: EngineConfig fields}; yields {name: engine}.

    Each gets room for the long in-flight request and the tests' token; all end on exit.
    """
    from vime.config import EngineConfig
    from vime.engines.vllm_engine import VLLMEngine

    engines = {
        name: VLLMEngine(
            EngineConfig(
                **{
                    "max_model_len": 2048,
                    "startup_timeout_s": 400,
                    "request_timeout_s": 60,
                    "auth_token": TOKEN,
                    **fields,
                }
            ),
            rank=index,
            log_dir=log_dir,
        )
        for index, (name, fields) in enumerate(specs.items())
    }
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda engine: engine.init(), engines.values()))
        yield engines
    finally:
        for engine in engines.values():
            engine.shutdown()


def assert_continues_like_a_fresh_model(record: dict, exported: dict, hf: HFReference) -> None:
    """A weight switch mid-request: after a keep pause with clear_cache=True the request
    re-prefills, so its tokens after the switch are what the new weights generate from prompt +
    old tokens."""
    assert record["report"].prefix_cache_flushed is True
    version = str(record["step"].version)
    tokens = record["inflight"]["token_ids"]
    versions = record["inflight"]["weight_versions"]
    switch = versions.index(version)
    assert 0 < switch < len(tokens) - SWITCH_CHECK_TOKENS, (switch, len(tokens))
    assert set(versions[switch:]) == {version}
    assert record["inflight"]["finish_reason"] == "length"
    model = hf.load(exported)
    expected = hf_greedy(model, [*PROMPT_IDS, *tokens[:switch]], SWITCH_CHECK_TOKENS)
    assert tokens[switch : switch + SWITCH_CHECK_TOKENS] == expected


def assert_switched_between_two_steps(record: dict, before: dict, after: dict, hf) -> bool:
    """A shadow sync committed between two scheduler steps (no pause) while a greedy request
    decoded: every token labelled with the old version is what the old weights make, every
    token from the first one labelled new on is what the new weights make from there, reading
    the old weights' KV cache for the tokens before (nothing was recomputed). Returns whether
    the check had power here: the old weights, going on, would have made other tokens (by
    chance they may not, over a short window: the caller asks it of one sync in several)."""
    version = str(record["step"].version)
    tokens = record["inflight"]["token_ids"]
    versions = record["inflight"]["weight_versions"]
    assert record["inflight"]["finish_reason"] == "length"
    switch = versions.index(version)
    assert 0 < switch < len(tokens) - SWITCH_CHECK_TOKENS, (switch, len(tokens))
    assert len(set(versions[:switch])) == 1 and set(versions[switch:]) == {version}
    old, new = hf.load(before), hf.load(after)
    assert tokens[:switch] == hf_greedy(old, PROMPT_IDS, switch)
    n = SWITCH_CHECK_TOKENS
    expected = hf_greedy_across_switch(old, new, PROMPT_IDS, tokens, switch, n)
    assert tokens[switch : switch + n] == expected
    return hf_greedy_across_switch(old, old, PROMPT_IDS, tokens, switch, n) != expected
