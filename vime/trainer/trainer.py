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
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vime.config import GRPOConfig, TrainerConfig
from vime.megatron.converters import get_converter
from vime.megatron.forward import logprobs_from_logits, stage_forward
from vime.megatron.model import (
    build_gpt_chunks,
    load_hf_checkpoint,
    load_hf_config,
    pad_vocab_size,
    unwrap,
)
from vime.megatron.routing_replay import replay_routes
from vime.megatron.topology import Topology
from vime.rl.loss import group_advantages, grpo_loss, importance_log_weights
from vime.rl.samples import PackedBatch
from vime.trainer.batches import MicroBatch, split_micro_batches
from vime.trainer.gradients import clip_by_global_norm, reduce_gradients
from vime.trainer.stats import StepStats

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MegatronTrainer:
    """Owns the model shards and optimizer of this rank.

    `model` is the list of this rank's model chunks (one per virtual pipeline stage; one without
    virtual stages), as megatron's schedules and vime's weight sync take it.

    `temperature`, `top_p`, `top_k`: the rollouts' sampling (`rollout.temperature` etc.).
    The RL log-probs are those of the distribution the engines sampled from, as the engines
    return them (`--logprobs-mode processed_logprobs`), so importance weights compare like with
    like (`logprobs_from_logits`)."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        model_path: str,
        topology: Topology,
        grpo: GRPOConfig,
        dp_group: Any = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ):
        torch.manual_seed(config.seed)
        if torch.cuda.is_available():
            # megatron's layers fork its CUDA RNG tracker (dropout); the CPU shims stub it.
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        self.config = config
        self.grpo = grpo
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.topology = topology
        self.dp_group = dp_group
        self.hf_config = load_hf_config(model_path)
        self.vocab_size = self.hf_config.vocab_size
        self.converter = get_converter(
            self.hf_config,
            padded_vocab_size=pad_vocab_size(self.vocab_size, topology.tp_size),
        )
        self.model = self._build_chunks()
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

    def _build_chunks(self) -> list[torch.nn.Module]:
        # With moe_routing_replay the routers (the reference's too) take the rollout's experts.
        replay = {"moe_enable_routing_replay": True} if self.config.moe_routing_replay else {}
        dtype = _DTYPES[self.config.params_dtype]
        return build_gpt_chunks(self.converter, self.topology, params_dtype=dtype, **replay)

    def _frozen_copy(self, model_path: str) -> list[torch.nn.Module]:
        chunks = self._build_chunks()
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
    ) -> list[MicroBatch]:
        # The interleaved schedule needs at least PP micro-batches.
        least = self.topology.pp_size if self.topology.vp_size > 1 else 1
        return split_micro_batches(
            batch, advantages, mine, self.config.micro_batch_size, least, self.device
        )

    def _schedule(
        self,
        model: list[torch.nn.Module],
        micro_batches: list[MicroBatch],
        loss_of: Callable[[MicroBatch, torch.Tensor], tuple],
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
            routes = micro.routes if self.config.moe_routing_replay else None
            with replay_routes(chunk, routes):  # no-op without routes
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

    def _logprobs(
        self,
        output: torch.Tensor,
        micro: MicroBatch,
        model: list[torch.nn.Module],
        sampled: bool = True,
    ) -> torch.Tensor:
        """The targets' log-probs: under the rollouts' sampling distribution (`sampled`, RL),
        or the model's own (supervised steps)."""
        return logprobs_from_logits(
            output,
            micro.input_ids[:, 1:],
            vocab_size=self.vocab_size,
            tp_group=unwrap(model[-1]).output_layer.tp_group,  # the last chunk has the head
            temperature=self.temperature if sampled else 1.0,
            top_p=self.top_p if sampled else 1.0,
            top_k=self.top_k if sampled else -1,
        )

    def _reference_logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Each micro-batch's log-probs under the frozen reference (on the last stage; [] on
        the others), by a forward-only pass of the same schedule."""
        assert self.reference is not None
        reference = self.reference

        def loss_of(micro: MicroBatch, output: torch.Tensor):
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
        stats = StepStats()
        off_policy = self.grpo.off_policy
        weighted = off_policy.level != "off"

        def loss_of(micro: MicroBatch, output: torch.Tensor):
            train_logprobs = self._logprobs(output, micro, self.model)
            loss, metrics = grpo_loss(
                train_logprobs,
                micro.rollout_logprobs,
                micro.advantages,
                micro.mask,
                config=self.grpo,
                # One update per batch: the policy before it is the one being trained, so the
                # importance weights are exp(old - rollout) with old = the current log-probs.
                old_logprobs=train_logprobs.detach() if weighted else None,
                ref_logprobs=None if ref_logprobs is None else ref_logprobs[micro.index],
                num_batch_tokens=num_batch_tokens,
                num_batch_sequences=float(batch.input_ids.shape[0]),
            )
            stats.add(metrics, float(micro.mask.sum()))
            if weighted:
                log_weights = importance_log_weights(
                    train_logprobs.detach(), micro.rollout_logprobs, micro.mask, off_policy.level
                )
                stats.add_histogram("is_weight", log_weights, micro.mask)
            if weight_version is not None and micro.versions is not None:
                stats.add_same_version(train_logprobs.detach(), micro, weight_version)
            # (loss, token count, collected): the schedule backpropagates the loss as it is.
            return loss, torch.tensor(int(micro.mask.sum()), dtype=torch.int), {}

        metrics = self._update(micro_batches, loss_of, stats, f"at step {self.num_steps + 1}")
        self.num_steps += 1
        metrics["time_s"] = time.monotonic() - started
        metrics["weight_l1"] = self.weight_l1()
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
        stats = StepStats()

        def loss_of(micro: MicroBatch, output: torch.Tensor):
            logprobs = self._logprobs(output, micro, self.model, sampled=False)
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
        micro_batches: list[MicroBatch],
        loss_of: Callable[[MicroBatch, torch.Tensor], tuple],
        stats: StepStats,
        what: str,
    ) -> dict[str, float]:
        """Gradients of every micro-batch's loss (the schedule), summed over DP and the tied
        copies, clipped, one AdamW step; the step's metrics (`loss_of` fills `stats`)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._schedule(self.model, micro_batches, loss_of, forward_only=False)
        timeout = timedelta(seconds=self.config.collective_timeout_s)
        reduce_gradients(self.model, self.topology, self.dp_group, timeout)
        grad_norm = clip_by_global_norm(
            self.parameters(), self.topology, self.config.grad_clip, timeout
        )
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

    def _share_metrics(self, stats: StepStats) -> dict[str, float]:
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

    def weight_l1(self) -> float:
        """The L1 norm of this rank's weights (its TP/PP shard), one read of each, float64
        accumulation, no copy: logged each step as `train/weight_l1` (drift shows in it; it
        changes whenever any weight does). One rank: the exported model's sum of |w|."""
        with torch.no_grad():
            return float(
                sum(torch.linalg.vector_norm(p, 1, dtype=torch.float64) for p in self.parameters())
            )
