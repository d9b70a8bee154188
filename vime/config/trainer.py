"""The `trainer:` section: megatron-core parallelism and optimisation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from vime.config.base import StrictModel


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
    params_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
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
    moe_routing_replay: bool = Field(
        False,
        description=(
            "MoE models: the trainer's routers take the experts the engine routed each token "
            "to (R3), from the engines' routed_experts (started with "
            "--enable-return-routed-experts); every sample of a batch must carry them. vLLM "
            "0.32's CPU build does not return them."
        ),
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

    def model_post_init(self, __context: Any) -> None:
        vp = self.virtual_pipeline_parallel_size
        if vp is not None and vp > 1 and self.pipeline_parallel_size == 1:
            raise ValueError(
                f"trainer.virtual_pipeline_parallel_size={vp} needs "
                "trainer.pipeline_parallel_size > 1"
            )
