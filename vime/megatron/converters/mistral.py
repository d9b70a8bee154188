"""Mistral (MistralForCausalLM): the Llama layout (no biases, dense SwiGLU MLP, GQA); vLLM serves
it with its Llama implementation. Sliding-window attention is refused unless the window covers
every position (megatron's local spec attends to the whole causal prefix).
"""

from __future__ import annotations

from typing import Any

from vime.megatron.converters.llama import LlamaConverter


class MistralConverter(LlamaConverter):
    architecture = "MistralForCausalLM"

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        window = getattr(hf_config, "sliding_window", None)
        if window is not None and window < hf_config.max_position_embeddings:
            raise ValueError(
                f"{cls.architecture}: sliding_window={window} < max_position_embeddings="
                f"{hf_config.max_position_embeddings}: sliding-window attention is not "
                "supported; set sliding_window to null (or >= max_position_embeddings)"
            )
