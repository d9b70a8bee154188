"""The trainer: a megatron-core GPTModel over TP x PP x DP ranks; GRPO steps, and SFT steps first.

Every rank calls `train_step` with the same packed batch; each data-parallel rank takes its slice
and runs it in micro-batches through megatron-core's own schedule (`get_forward_backward_func`:
1F1B over the pipeline stages at PP>1; the loss, on the last stage, normalised by the whole
batch's token count), then sums gradients over DP (and a tied embedding's over its first- and
last-stage copies), clips by the global norm and steps. With `grpo.kl_coef > 0` a frozen copy of
the initial weights (after an SFT stage: of the SFT weights, `start_rl`), sharded like the policy,
gives each token's reference log-prob for the KL penalty, by a forward-only pass of the same
schedule. `sft_step` is the supervised step (next-token cross-entropy) of the warm start.

    trainer = MegatronTrainer(config, model_path=..., topology=topology, grpo=grpo)
    metrics = trainer.train_step(packed_batch)
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field

from vime.config import StrictModel
from vime.megatron.converters import get_converter
from vime.megatron.model import (
    build_gpt_chunks,
    load_hf_checkpoint,
    load_hf_config,
    logprobs_from_logits,
    pad_vocab_size,
    stage_forward,
    unwrap,
)
from vime.megatron.topology import Topology
from vime.rl.loss import GRPOConfig, group_advantages, grpo_loss
from vime.rl.samples import PackedBatch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TrainerConfig(StrictModel):
    """Model parallelism and optimisation of the megatron trainer."""

    tensor_parallel_size: int = Field(1, ge=1, description="Megatron TP degree.")
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Megatron PP degree (megatron's 1F1B schedule over the stages)."
    )
    virtual_pipeline_parallel_size: int | None = Field(
        None,
        ge=1,
        description=(
            "Model chunks per pipeline rank (megatron's interleaved 1F1B); needs "
            "pipeline_parallel_size > 1 and num_layers divisible by PP x VPP. None: one chunk."
        ),
    )
    params_dtype: str = Field("float32", description="Parameter dtype: float32 or bfloat16.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this.")
    micro_batch_size: int = Field(
        16,
        ge=1,
        description=(
            "Most sequences per forward/backward; a DP rank's samples are split into "
            "ceil(n / micro_batch_size) micro-batches of one size (the last padded)."
        ),
    )
    collective_timeout_s: float = Field(
        600.0, gt=0, description="Timeout of the trainer's collectives (DP gradient sums)."
    )
    seed: int = Field(0, description="Torch seed on every rank.")
    cpu_cores: Literal["auto"] | list[int] | None = Field(
        None,
        description=(
            "CPU only: pin the trainer ranks' threads to these cores (applied after the engines "
            "start, so they keep theirs). 'auto': the last core, which vLLM's default OpenMP "
            "binding leaves to its API server, when a single local engine shares the host. "
            "None leaves the affinity alone (torch then spins on the engine's core too: on 2 "
            "cores a train step took 0.95 s instead of 0.15 s)."
        ),
    )

    def resolve_cpu_cores(self, num_local_engines: int) -> list[int] | None:
        """The cores to pin to on this host, or None."""
        if self.cpu_cores != "auto":
            return self.cpu_cores
        cores = sorted(os.sched_getaffinity(0))
        if num_local_engines != 1 or len(cores) < 2:
            return None
        return cores[-1:]

    def model_post_init(self, __context: Any) -> None:
        if self.params_dtype not in _DTYPES:
            raise ValueError(
                f"trainer.params_dtype={self.params_dtype!r}; choose one of {sorted(_DTYPES)}"
            )
        vp = self.virtual_pipeline_parallel_size
        if vp is not None and vp > 1 and self.pipeline_parallel_size == 1:
            raise ValueError(
                f"trainer.virtual_pipeline_parallel_size={vp} needs "
                "trainer.pipeline_parallel_size > 1"
            )


class MegatronTrainer:
    """Owns the model shards and optimizer of this rank.

    `model` is the list of this rank's model chunks (one per virtual pipeline stage; one without
    virtual stages), as megatron's schedules and vime's weight sync take it."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        model_path: str,
        topology: Topology,
        grpo: GRPOConfig,
        dp_group: Any = None,
    ):
        torch.manual_seed(config.seed)
        if torch.cuda.is_available():
            # megatron's layers fork its CUDA RNG tracker (dropout); the CPU shims stub it.
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        self.config = config
        self.grpo = grpo
        self.topology = topology
        self.dp_group = dp_group
        self.hf_config = load_hf_config(model_path)
        self.vocab_size = self.hf_config.vocab_size
        self.converter = get_converter(
            self.hf_config,
            padded_vocab_size=pad_vocab_size(self.vocab_size, topology.tp_size),
        )
        self.model = build_gpt_chunks(
            self.converter, topology, params_dtype=_DTYPES[config.params_dtype]
        )
        load_hf_checkpoint(self.model, model_path, converter=self.converter, topology=topology)
        # The KL penalty's reference policy: the initial weights (the SFT ones after start_rl),
        # sharded like the policy, frozen.
        self.reference = self._frozen_copy(model_path) if grpo.kl_coef > 0 else None
        self.optimizer = self._new_optimizer()
        self.num_steps = 0

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter of this rank's chunks, chunk by chunk."""
        return [param for chunk in self.model for param in chunk.parameters()]

    def _new_optimizer(self, lr: float | None = None) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad],
            lr=self.config.lr if lr is None else lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )

    def _frozen_copy(self, model_path: str) -> list[torch.nn.Module]:
        chunks = build_gpt_chunks(
            self.converter, self.topology, params_dtype=_DTYPES[self.config.params_dtype]
        )
        load_hf_checkpoint(chunks, model_path, converter=self.converter, topology=self.topology)
        for chunk in chunks:
            for param in chunk.parameters():
                param.requires_grad_(False)
            chunk.eval()
        return chunks

    def _dp_slice(self, num_samples: int, fix: str) -> slice:
        """This DP rank's contiguous share of the samples (advantages are computed before)."""
        dp_size, dp_rank = self.topology.dp_size, self.topology.dp_rank
        if num_samples % dp_size:
            raise ValueError(
                f"batch of {num_samples} samples does not split over {dp_size} data-parallel "
                f"ranks; make {fix} a multiple of DP"
            )
        per_rank = num_samples // dp_size
        return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)

    def _micro_batches(
        self, batch: PackedBatch, advantages: torch.Tensor, mine: slice
    ) -> list[_MicroBatch]:
        """This DP rank's samples in micro-batches of one size (pipeline stages exchange
        activations of a fixed shape): ceil(n / micro_batch_size) of them, as even as possible,
        the last padded with rows that carry no loss (mask 0)."""
        device = self.device
        n = mine.stop - mine.start
        count = math.ceil(n / self.config.micro_batch_size)
        if self.topology.vp_size > 1:
            # The interleaved schedule needs at least PP micro-batches.
            count = max(count, self.topology.pp_size)
        size = math.ceil(n / count)
        pad = count * size - n

        def rows(tensor: torch.Tensor, fill: float) -> torch.Tensor:
            tensor = tensor[mine]
            if pad:
                filler = torch.full((pad, *tensor.shape[1:]), fill, dtype=tensor.dtype)
                tensor = torch.cat([tensor, filler])
            return tensor.to(device)

        # The packed batch lives on the CPU; the model on its device (a GPU when there is one).
        input_ids = rows(batch.input_ids, 0)
        mask = rows(batch.loss_mask, 0)
        rollout = rows(batch.rollout_logprobs, 0)
        advantages = rows(advantages, 0)
        versions = None if batch.token_versions is None else rows(batch.token_versions, -1)
        return [
            _MicroBatch(
                index=i,
                input_ids=input_ids[i * size : (i + 1) * size],
                mask=mask[i * size : (i + 1) * size],
                rollout_logprobs=rollout[i * size : (i + 1) * size],
                advantages=advantages[i * size : (i + 1) * size],
                versions=None if versions is None else versions[i * size : (i + 1) * size],
            )
            for i in range(count)
        ]

    def _schedule(
        self,
        model: list[torch.nn.Module],
        micro_batches: list[_MicroBatch],
        loss_of: Callable[[_MicroBatch, torch.Tensor], tuple],
        *,
        forward_only: bool,
    ) -> list:
        """Megatron's own forward/backward schedule over the micro-batches: no pipelining at
        PP=1, 1F1B at PP>1 (activations and their gradients sent between stages), interleaved
        1F1B over the chunks with virtual stages. `loss_of` runs on the last stage (the last
        chunk of the last rank); its outputs' last element is collected and returned there."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, chunk):
            micro = next(data_iterator)
            output = stage_forward(chunk, micro.input_ids[:, :-1])
            return output, functools.partial(loss_of, micro)

        first = micro_batches[0]
        data_iterator: Any = iter(micro_batches)
        if len(model) > 1:
            # Every chunk runs every micro-batch, each from its own iterator; one group of all
            # micro-batches satisfies the schedule for any count >= PP.
            data_iterator = [iter(micro_batches) for _ in model]
            unwrap(model[0]).config.microbatch_group_size_per_vp_stage = len(micro_batches)
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=len(micro_batches),
            seq_length=first.input_ids.shape[1] - 1,
            micro_batch_size=first.input_ids.shape[0],
            forward_only=forward_only,
        )

    def _logprobs(self, output: torch.Tensor, micro: _MicroBatch, model: list[torch.nn.Module]):
        return logprobs_from_logits(
            output,
            micro.input_ids[:, 1:],
            vocab_size=self.vocab_size,
            tp_group=unwrap(model[-1]).output_layer.tp_group,  # the last chunk has the head
        )

    def _reference_logprobs(self, micro_batches: list[_MicroBatch]) -> list[torch.Tensor]:
        """Each micro-batch's log-probs under the frozen reference (on the last stage; [] on
        the others), by a forward-only pass of the same schedule."""
        assert self.reference is not None
        reference = self.reference

        def loss_of(micro: _MicroBatch, output: torch.Tensor):
            zero = torch.zeros((), device=output.device)
            return zero, {"logprobs": self._logprobs(output, micro, reference)}

        with torch.no_grad():
            store = self._schedule(reference, micro_batches, loss_of, forward_only=True)
        return [item["logprobs"] for item in store]

    def train_step(self, batch: PackedBatch, weight_version: int | None = None) -> dict[str, float]:
        """One optimizer step on `batch` (the same on every rank); returns the step's metrics,
        the same on every rank (summed over DP, sent from the last pipeline stage).

        `weight_version`: the version the engines hold of this trainer's current weights. Samples
        generated entirely by that version must get the same log-probs here as in the engine;
        their mean |difference| (`logprob_diff_same_version`) is the online check that sync is
        exact, free of the staleness that `logprob_diff` (all tokens) includes.
        """
        started = time.monotonic()
        self._train_mode()
        advantages = group_advantages(
            batch.rewards,
            batch.group_size,
            eps=self.grpo.advantage_eps,
            normalize_std=self.grpo.normalize_std,
        )
        micro_batches = self._micro_batches(
            batch,
            advantages,
            self._dp_slice(
                batch.input_ids.shape[0], "rollout.num_prompts_per_step * num_samples_per_prompt"
            ),
        )
        ref_logprobs = None
        if self.reference is not None:
            ref_logprobs = self._reference_logprobs(micro_batches)
        # Normalise by the whole batch's token count, so micro-batches and DP ranks sum to its mean.
        num_batch_tokens = float(batch.loss_mask.sum())
        stats = _StepStats()

        def loss_of(micro: _MicroBatch, output: torch.Tensor):
            train_logprobs = self._logprobs(output, micro, self.model)
            loss, metrics = grpo_loss(
                train_logprobs,
                micro.rollout_logprobs,
                micro.advantages,
                micro.mask,
                config=self.grpo,
                # One update per batch: the policy before it is the one being trained, so truncated
                # IS weighs exp(old - rollout) with old = the current log-probs, detached.
                old_logprobs=train_logprobs.detach() if self.grpo.tis_cap is not None else None,
                ref_logprobs=None if ref_logprobs is None else ref_logprobs[micro.index],
                num_batch_tokens=num_batch_tokens,
                num_batch_sequences=float(batch.input_ids.shape[0]),
            )
            stats.add(metrics, float(micro.mask.sum()))
            if weight_version is not None and micro.versions is not None:
                stats.add_same_version(train_logprobs.detach(), micro, weight_version)
            # (loss, token count, collected): the schedule backpropagates the loss as it is.
            return loss, torch.tensor(int(micro.mask.sum()), dtype=torch.int), {}

        metrics = self._update(micro_batches, loss_of, stats, f"at step {self.num_steps + 1}")
        self.num_steps += 1
        metrics["time_s"] = time.monotonic() - started
        return metrics

    def sft_step(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
        """One supervised step: mean next-token cross-entropy over the masked tokens of the
        whole batch (the same on every rank); returns its metrics, the same on every rank."""
        started = time.monotonic()
        self._train_mode()
        num = input_ids.shape[0]
        batch = PackedBatch(input_ids, loss_mask, torch.zeros_like(loss_mask), torch.zeros(num), 1)
        mine = self._dp_slice(num, "sft.batch_size")
        micro_batches = self._micro_batches(batch, torch.zeros(num), mine)
        num_batch_tokens = float(loss_mask.sum())
        stats = _StepStats()

        def loss_of(micro: _MicroBatch, output: torch.Tensor):
            logprobs = self._logprobs(output, micro, self.model)
            loss = -(logprobs * micro.mask).sum() / num_batch_tokens
            tokens = float(micro.mask.sum())
            with torch.no_grad():
                # Targets given probability > 1/2 (so certainly the greedy choice).
                confident = (logprobs > math.log(0.5)).float()
                stats.add(
                    {
                        "loss": loss.item(),
                        "num_tokens": tokens,
                        "confident_fraction": float((confident * micro.mask).sum())
                        / max(tokens, 1),
                    },
                    tokens,
                )
            return loss, torch.tensor(int(tokens), dtype=torch.int), {}

        metrics = self._update(micro_batches, loss_of, stats, "in a supervised step")
        metrics.pop("same_version_token_fraction", None)
        metrics["time_s"] = time.monotonic() - started
        return metrics

    def _update(
        self,
        micro_batches: list[_MicroBatch],
        loss_of: Callable[[_MicroBatch, torch.Tensor], tuple],
        stats: _StepStats,
        what: str,
    ) -> dict[str, float]:
        """Gradients of every micro-batch's loss (the schedule), summed over DP and the tied
        copies, clipped, one AdamW step; the step's metrics (`loss_of` fills `stats`)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._schedule(self.model, micro_batches, loss_of, forward_only=False)
        self._reduce_gradients()
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        metrics = self._share_metrics(stats)
        metrics["grad_norm"] = float(grad_norm)
        if not math.isfinite(metrics["grad_norm"]):
            raise FloatingPointError(f"non-finite gradient norm {what}")
        return metrics

    def _train_mode(self) -> None:
        for chunk in self.model:
            chunk.train()

    def start_sft(self, lr: float | None = None) -> None:
        """Before a supervised stage: a fresh optimizer at `lr` (None: trainer.lr)."""
        self.optimizer = self._new_optimizer(lr)

    def start_rl(self) -> None:
        """After a supervised stage: RL starts from these weights with a fresh optimizer, and
        the KL penalty's reference becomes them (the SFT model), as in real post-training."""
        self.optimizer = self._new_optimizer()
        if self.reference is not None:
            with torch.no_grad():
                for ref_chunk, chunk in zip(self.reference, self.model, strict=True):
                    for ref, param in zip(ref_chunk.parameters(), chunk.parameters(), strict=True):
                        ref.copy_(param)

    def _share_metrics(self, stats: _StepStats) -> dict[str, float]:
        """The last stage's metrics summed over DP, then sent to every stage (as JSON bytes)."""
        from megatron.core import parallel_state

        timeout = timedelta(seconds=self.config.collective_timeout_s)
        metrics: dict[str, float] = {}
        # On the model's device: on GPUs megatron's DP and PP groups are NCCL, which refuses CPU
        # tensors.
        device = self.device
        if self.topology.is_last_stage:
            if self.topology.dp_size > 1:
                stats.all_reduce(self.dp_group, timeout, device)
            metrics = stats.metrics()
        if self.topology.pp_size == 1:
            return metrics
        group = parallel_state.get_pipeline_model_parallel_group()
        source = parallel_state.get_pipeline_model_parallel_last_rank()
        payload = json.dumps(metrics).encode() if self.topology.is_last_stage else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        dist.broadcast(length, src=source, group=group, async_op=True).wait(timeout)
        data = torch.zeros(int(length), dtype=torch.uint8, device=device)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        dist.broadcast(data, src=source, group=group, async_op=True).wait(timeout)
        return json.loads(bytes(data.cpu().tolist()).decode())

    @property
    def device(self) -> torch.device:
        return next(self.model[0].parameters()).device

    def param_fingerprint(self) -> float:
        """A cheap number that changes whenever this rank's weights change (for run checks)."""
        with torch.no_grad():
            return float(sum(p.double().abs().sum() for p in self.parameters()))

    def _clip_gradients(self) -> float:
        """Clip by the global norm over the whole model; every rank gets the same factor.

        A TP-sharded parameter contributes its shard on every TP rank; a replicated one (norms,
        biases of row-parallel layers) only on TP rank 0; each pipeline stage its own layers,
        the last stage's copy of a tied embedding (`shared`) not at all. The sum over the
        model-parallel (TP x PP) group then counts every element once.
        """
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for param in self.parameters():
            if param.grad is None or getattr(param, "shared", False):
                continue
            sharded = getattr(param, "tensor_model_parallel", False)
            if sharded or self.topology.tp_rank == 0:
                squares += param.grad.detach().double().pow(2).sum()
        if self.topology.tp_size * self.topology.pp_size > 1:
            from megatron.core import parallel_state

            work = dist.all_reduce(
                squares, group=parallel_state.get_model_parallel_group(), async_op=True
            )
            work.wait(timedelta(seconds=self.config.collective_timeout_s))
        total_norm = float(squares.sqrt())
        factor = self.config.grad_clip / (total_norm + 1e-6)
        if factor < 1.0:
            for param in self.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor)
        return total_norm

    def _reduce_gradients(self) -> None:
        """Sum gradients over data-parallel ranks (the loss already divides by global tokens),
        and a tied embedding's over its two copies (first and last pipeline stage)."""
        timeout = timedelta(seconds=self.config.collective_timeout_s)
        if self.topology.pp_size > 1:
            from megatron.core import parallel_state

            for chunk in map(unwrap, self.model):
                # The chunk that embeds (first rank, first chunk) and the one with the output
                # layer (last rank, last chunk) hold the two copies; middle chunks neither.
                if not chunk.share_embeddings_and_output_weights:
                    continue
                if not (chunk.pre_process or chunk.post_process):
                    continue
                weight = chunk.shared_embedding_or_output_weight()
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
                group = parallel_state.get_embedding_group()
                dist.all_reduce(weight.grad, group=group, async_op=True).wait(timeout)
        if self.topology.dp_size == 1:
            return
        for param in self.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            work = dist.all_reduce(param.grad, group=self.dp_group, async_op=True)
            work.wait(timeout)


@dataclass
class _MicroBatch:
    """One micro-batch of this DP rank's samples (rows past the real ones have mask 0)."""

    index: int
    input_ids: torch.Tensor  # [size, seq]
    mask: torch.Tensor  # [size, seq - 1], 1 on response tokens
    rollout_logprobs: torch.Tensor  # [size, seq - 1]
    advantages: torch.Tensor  # [size]
    versions: torch.Tensor | None  # [size, seq - 1] weight version of each token, -1 on padding


class _StepStats:
    """The loss metrics of one step's micro-batches, on the last stage: `loss` and `num_tokens`
    summed, `*_max` maxed, the rest token-weighted means."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}
        self.num_tokens = 0.0
        self.same_version_diff = 0.0
        self.same_version_tokens = 0.0

    def add(self, metrics: dict[str, float], num_tokens: float) -> None:
        self.num_tokens += num_tokens
        for key, value in metrics.items():
            if key.endswith("_max"):
                self.maxes[key] = max(self.maxes.get(key, -math.inf), value)
            else:
                weight = 1.0 if key in ("loss", "num_tokens") else num_tokens
                self.sums[key] = self.sums.get(key, 0.0) + weight * value

    def add_same_version(
        self, train_logprobs: torch.Tensor, micro: _MicroBatch, weight_version: int
    ) -> None:
        """|train - rollout| on samples generated entirely by `weight_version`. Whole samples
        only: one that straddled a sync (keep pause, clear_cache false) continues on KV computed
        by the old weights, so even its new-version tokens differ from a recompute."""
        assert micro.versions is not None
        on = micro.mask > 0
        whole = ((micro.versions == weight_version) | ~on).all(dim=1) & on.any(dim=1)
        same = whole[:, None] & on
        diff = (train_logprobs - micro.rollout_logprobs).abs()
        self.same_version_diff += float(diff[same].sum())
        self.same_version_tokens += float(same.sum())

    def all_reduce(self, group: Any, timeout: timedelta, device: torch.device) -> None:
        """Sum (max) over the data-parallel ranks, which hold the same keys."""
        sum_keys, max_keys = sorted(self.sums), sorted(self.maxes)
        sums = torch.tensor(
            [self.sums[k] for k in sum_keys]
            + [self.num_tokens, self.same_version_diff, self.same_version_tokens],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(sums, group=group, async_op=True).wait(timeout)
        *values, self.num_tokens, self.same_version_diff, self.same_version_tokens = sums.tolist()
        self.sums = dict(zip(sum_keys, values, strict=True))
        if max_keys:
            maxes = torch.tensor(
                [self.maxes[k] for k in max_keys], dtype=torch.float64, device=device
            )
            work = dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group, async_op=True)
            work.wait(timeout)
            self.maxes = dict(zip(max_keys, maxes.tolist(), strict=True))

    def metrics(self) -> dict[str, float]:
        tokens = max(self.num_tokens, 1.0)
        metrics = {
            key: value if key in ("loss", "num_tokens") else value / tokens
            for key, value in self.sums.items()
        }
        metrics.update(self.maxes)
        if self.same_version_tokens:
            metrics["logprob_diff_same_version"] = self.same_version_diff / self.same_version_tokens
        metrics["same_version_token_fraction"] = self.same_version_tokens / tokens
        return metrics
