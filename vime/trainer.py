"""The RL trainer: a megatron-core GPTModel over TP x DP ranks, one GRPO optimizer step per batch.

Every rank calls `train_step` with the same packed batch; each data-parallel rank takes its slice,
runs micro-batches (gradient accumulation, the loss normalised by the whole batch's token count),
sums gradients over DP, clips and steps. With `grpo.kl_coef > 0` a frozen copy of the initial
weights (sharded like the policy) gives each token's reference log-prob for the KL penalty.
Pipeline parallel training is not supported yet (PP > 1 is rejected by TrainerConfig); weight
sync itself handles PP.

    trainer = MegatronTrainer(config, model_path=..., topology=topology, grpo=grpo)
    metrics = trainer.train_step(packed_batch)
"""

from __future__ import annotations

import logging
import math
import os
import time
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field

from vime.config import StrictModel
from vime.megatron.converters import get_converter
from vime.megatron.model import (
    build_gpt_model,
    load_hf_checkpoint,
    load_hf_config,
    pad_vocab_size,
    token_logprobs,
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
        1, ge=1, le=1, description="Megatron PP degree; training supports 1 for now."
    )
    params_dtype: str = Field("float32", description="Parameter dtype: float32 or bfloat16.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this.")
    micro_batch_size: int = Field(16, ge=1, description="Sequences per forward/backward.")
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


class MegatronTrainer:
    """Owns the model shards and optimizer of this rank."""

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
        self.model = build_gpt_model(
            self.converter, topology, params_dtype=_DTYPES[config.params_dtype]
        )
        load_hf_checkpoint(self.model, model_path, converter=self.converter, topology=topology)
        # The KL penalty's reference policy: the initial weights, sharded like the policy, frozen.
        self.reference = self._frozen_copy(model_path) if grpo.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )
        self.num_steps = 0

    def _frozen_copy(self, model_path: str) -> torch.nn.Module:
        model = build_gpt_model(
            self.converter, self.topology, params_dtype=_DTYPES[self.config.params_dtype]
        )
        load_hf_checkpoint(model, model_path, converter=self.converter, topology=self.topology)
        for param in model.parameters():
            param.requires_grad_(False)
        return model.eval()

    def _dp_slice(self, num_samples: int) -> slice:
        """This DP rank's samples: whole groups never split (advantages are per group)."""
        dp_size, dp_rank = self.topology.dp_size, self.topology.dp_rank
        if num_samples % dp_size:
            raise ValueError(
                f"batch of {num_samples} samples does not split over {dp_size} data-parallel "
                "ranks; make num_prompts_per_step * num_samples_per_prompt a multiple of DP"
            )
        per_rank = num_samples // dp_size
        return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)

    def train_step(self, batch: PackedBatch, weight_version: int | None = None) -> dict[str, float]:
        """One optimizer step on `batch` (the same on every rank); returns rank-local metrics.

        `weight_version`: the version the engines hold of this trainer's current weights. Samples
        generated entirely by that version must get the same log-probs here as in the engine;
        their mean |difference| (`logprob_diff_same_version`) is the online check that sync is
        exact, free of the staleness that `logprob_diff` (all tokens) includes.
        """
        started = time.monotonic()
        self.model.train()
        advantages = group_advantages(
            batch.rewards,
            batch.group_size,
            eps=self.grpo.advantage_eps,
            normalize_std=self.grpo.normalize_std,
        )
        mine = self._dp_slice(batch.input_ids.shape[0])
        # The packed batch lives on the CPU; the model on its device (a GPU when there is one).
        device = self.device
        input_ids = batch.input_ids[mine].to(device)
        mask = batch.loss_mask[mine].to(device)
        rollout_logprobs = batch.rollout_logprobs[mine].to(device)
        advantages = advantages[mine].to(device)
        # Normalise by the whole batch's token count, so micro-batches and DP ranks sum to its mean.
        num_batch_tokens = float(batch.loss_mask.sum())
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        num_tokens = 0.0
        same_version_diff = same_version_tokens = 0.0
        for start in range(0, input_ids.shape[0], self.config.micro_batch_size):
            end = start + self.config.micro_batch_size
            train_logprobs = token_logprobs(
                self.model, input_ids[start:end], vocab_size=self.vocab_size
            )
            ref_logprobs = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logprobs = token_logprobs(
                        self.reference, input_ids[start:end], vocab_size=self.vocab_size
                    )
            loss, metrics = grpo_loss(
                train_logprobs,
                rollout_logprobs[start:end],
                advantages[start:end],
                mask[start:end],
                config=self.grpo,
                # One update per batch: the policy before it is the one being trained, so truncated
                # IS weighs exp(old - rollout) with old = the current log-probs, detached.
                old_logprobs=train_logprobs.detach() if self.grpo.tis_cap is not None else None,
                ref_logprobs=ref_logprobs,
                num_batch_tokens=num_batch_tokens,
            )
            loss.backward()
            if weight_version is not None and batch.token_versions is not None:
                # Whole samples only: a sample that straddled a sync (keep pause, clear_cache
                # false) continues on KV computed by the old weights, so even its new-version
                # tokens differ from a recompute.
                versions = batch.token_versions[mine][start:end].to(device)
                on = mask[start:end] > 0
                whole = ((versions == weight_version) | ~on).all(dim=1) & on.any(dim=1)
                same = whole[:, None] & on
                diff = (train_logprobs.detach() - rollout_logprobs[start:end]).abs()
                same_version_diff += float(diff[same].sum())
                same_version_tokens += float(same.sum())
            # Each micro-batch's loss is its share of the batch loss: sum it. Other metrics are
            # means over the micro-batch's tokens: weight them by its token count.
            micro_tokens = float(mask[start:end].sum())
            num_tokens += micro_tokens
            for key, value in metrics.items():
                weight = 1.0 if key in ("loss", "num_tokens") else micro_tokens
                sums[key] = sums.get(key, 0.0) + weight * value
        self._reduce_gradients()
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.num_steps += 1
        metrics = {
            key: value if key in ("loss", "num_tokens") else value / max(num_tokens, 1.0)
            for key, value in sums.items()
        }
        if same_version_tokens:
            metrics["logprob_diff_same_version"] = same_version_diff / same_version_tokens
        metrics["same_version_token_fraction"] = same_version_tokens / max(num_tokens, 1.0)
        metrics["grad_norm"] = float(grad_norm)
        metrics["time_s"] = time.monotonic() - started
        if not math.isfinite(metrics["grad_norm"]):
            raise FloatingPointError(f"non-finite gradient norm at step {self.num_steps}")
        return metrics

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def param_fingerprint(self) -> float:
        """A cheap number that changes whenever this rank's weights change (for run checks)."""
        with torch.no_grad():
            return float(sum(p.double().abs().sum() for p in self.model.parameters()))

    def _clip_gradients(self) -> float:
        """Clip by the global norm over the whole model; every TP rank gets the same factor.

        A TP-sharded parameter contributes its shard on every TP rank; a replicated one (norms,
        biases of row-parallel layers) only on TP rank 0, so the sum over TP counts it once.
        """
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for param in self.model.parameters():
            if param.grad is None:
                continue
            sharded = getattr(param, "tensor_model_parallel", False)
            if sharded or self.topology.tp_rank == 0:
                squares += param.grad.detach().double().pow(2).sum()
        if self.topology.tp_size > 1:
            from megatron.core import parallel_state

            work = dist.all_reduce(
                squares, group=parallel_state.get_tensor_model_parallel_group(), async_op=True
            )
            work.wait(timedelta(seconds=self.config.collective_timeout_s))
        total_norm = float(squares.sqrt())
        factor = self.config.grad_clip / (total_norm + 1e-6)
        if factor < 1.0:
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor)
        return total_norm

    def _reduce_gradients(self) -> None:
        """Sum gradients over data-parallel ranks (the loss already divides by global tokens)."""
        if self.topology.dp_size == 1:
            return
        timeout = timedelta(seconds=self.config.collective_timeout_s)
        for param in self.model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            work = dist.all_reduce(param.grad, group=self.dp_group, async_op=True)
            work.wait(timeout)
