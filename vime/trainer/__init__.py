"""The trainer: megatron-core GPTModel chunks over TP x PP (x VPP) x DP ranks; GRPO and SFT steps.

- `trainer`: `MegatronTrainer` (model, optimizer, KL reference, the steps through megatron's
  schedule).
- `batches`: a data-parallel rank's micro-batches; `stats`: a step's metrics;
  `gradients`: tied-copy and data-parallel sums, global-norm clipping.
"""

from vime.trainer.trainer import MegatronTrainer

__all__ = ["MegatronTrainer"]
