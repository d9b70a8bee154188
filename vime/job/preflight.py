"""Everything a config names, resolved and checked before any process group, Ray or engine starts.

    config = preflight(load_config(TrainConfig, path, overrides))   # ValueError names the field

A mistake found after a 30-60 s engine start wastes that start on every rank; here it costs
milliseconds. Checked: the HF checkpoint (unless model.preset builds one) and that the trainer's
tensor parallelism splits its heads, every data file (read
and validated), the reward function (imported), the resume checkpoint, SFT's batch against its
demonstrations. Relative data paths are resolved from the working directory, else from vime's
package data, and written back absolute, so the resolved config (run_dir/config.resolved.json)
and every rank read the same files from any directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from vime.config import TrainConfig
from vime.rl.data import load_demonstrations, load_prompts, resolve_data_path
from vime.rl.rewards import load_reward_fn


def _field_error(field: str, value: object, problem: str) -> ValueError:
    return ValueError(f"{field}={value!r}: {problem}")


def _data_file(field: str, value: str, load=load_prompts) -> tuple[str, int]:
    """The file's absolute path and its number of records; ValueError naming `field`."""
    try:
        path = resolve_data_path(value)
        return str(path), len(load(str(path)))
    except ValueError as exc:
        raise _field_error(field, value, str(exc)) from None


def check_checkpoint(config: TrainConfig) -> None:
    """The trainer and the tokenizer read engine.model_path: it must be an HF checkpoint directory,
    unless model.preset builds one there."""
    path = Path(config.engine.model_path)
    if config.model.pretrained is not None:
        from vime.pretrained import PRETRAINED, gguf_path

        if config.model.pretrained not in PRETRAINED:
            raise _field_error(
                "model.pretrained", config.model.pretrained, f"choose one of {sorted(PRETRAINED)}"
            )
        try:
            gguf_path(config.model.pretrained)  # its package is installed
        except FileNotFoundError as exc:
            raise _field_error("model.pretrained", config.model.pretrained, str(exc)) from None
    if not config.model.builds and not (path / "config.json").is_file():
        what = "has no config.json" if path.is_dir() else "does not exist"
        raise _field_error(
            "engine.model_path",
            config.engine.model_path,
            f"{what}: give the directory of an HF checkpoint (config.json, safetensors, "
            "tokenizer), or set model.preset (a tiny random one) or model.pretrained to build "
            "one there",
        )


def check_tensor_parallel(config: TrainConfig) -> None:
    """The trainer's tensor parallelism must split the checkpoint's heads, its pipeline stages
    (virtual ones too) the decoder layers (megatron's rules)."""
    from vime.megatron.model import check_heads_split, check_layers_split

    path = Path(config.engine.model_path) / "config.json"
    if not path.is_file():  # built by the job: build_gpt_chunks checks the same rule
        return
    hf = json.loads(path.read_text())
    heads = hf.get("num_attention_heads")
    if isinstance(heads, int):
        kv_heads = hf.get("num_key_value_heads") or heads
        tp = config.trainer.tensor_parallel_size
        check_heads_split(heads, kv_heads, tp, "trainer.tensor_parallel_size")
    layers = hf.get("num_hidden_layers")
    pp, vp = config.trainer.pipeline_parallel_size, config.trainer.virtual_pipeline_parallel_size
    if isinstance(layers, int) and pp > 1:
        check_layers_split(layers, pp, vp, "trainer")


ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"


def routing_replay_engine_args(config: TrainConfig) -> list[str] | None:
    """trainer.moe_routing_replay: the engines' extra_args with vLLM's routed-experts flag (None:
    unchanged); refused for a checkpoint without experts."""
    if not config.trainer.moe_routing_replay:
        return None
    path = Path(config.engine.model_path) / "config.json"
    if path.is_file():
        hf = json.loads(path.read_text())
        if not (hf.get("num_experts") or hf.get("num_local_experts")):
            raise _field_error(
                "trainer.moe_routing_replay",
                True,
                f"{config.engine.model_path} is not a MoE model (no num_experts in its config)",
            )
    extra = list(config.engine.extra_args)
    return extra if ROUTED_EXPERTS_FLAG in extra else [*extra, ROUTED_EXPERTS_FLAG]


def preflight(config: TrainConfig) -> TrainConfig:
    """`config` with its data paths resolved; ValueError naming the first bad field."""
    check_checkpoint(config)
    check_tensor_parallel(config)
    rollout, _ = _data_file("rollout.prompts_path", config.rollout.prompts_path)
    try:
        load_reward_fn(config.rollout.reward_fn)
    except ValueError as exc:
        raise _field_error("rollout.reward_fn", config.rollout.reward_fn, str(exc)) from None
    updates: dict[str, object] = {
        "rollout": config.rollout.model_copy(update={"prompts_path": rollout})
    }
    engine_args = routing_replay_engine_args(config)
    if engine_args is not None:
        updates["engine"] = config.engine.model_copy(update={"extra_args": engine_args})
    if config.eval.prompts_path is not None:
        held_out, _ = _data_file("eval.prompts_path", config.eval.prompts_path)
        updates["eval"] = config.eval.model_copy(update={"prompts_path": held_out})
    if config.sft.data_path is not None:
        demos, count = _data_file("sft.data_path", config.sft.data_path, load_demonstrations)
        if config.sft.enabled and count < config.sft.batch_size:
            raise _field_error(
                "sft.batch_size",
                config.sft.batch_size,
                f"exceeds the {count} demonstrations in {demos}: lower it, or give more",
            )
        updates["sft"] = config.sft.model_copy(update={"data_path": demos})
    try:
        config.checkpoint.resume_path(config.run_dir)
    except ValueError as exc:
        raise _field_error("checkpoint.resume", config.checkpoint.resume, str(exc)) from None
    return config.model_copy(update=updates)
