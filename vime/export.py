"""`vime export RUN_DIR OUT`: a trainer checkpoint as an HF checkpoint (safetensors) that vLLM
serves and transformers loads.

The run's `config.resolved.json` says which model and checkpoint directory; the newest complete
checkpoint is exported unless `--checkpoint` names one. The weights are loaded on one process
(megatron-core reads any TP layout's checkpoint into TP=1), converted to HF names and layouts by the
same converter the weight sync uses, and written beside the base model's config and tokenizer files.
Relative paths in the run's config (engine.model_path, checkpoint.dir) are read from the current
directory, as the job read them: run it where the job ran.

    vime export runs/tiny-cpu-async exported/ && python -c "import transformers; ..."
"""

from __future__ import annotations

import argparse
import logging
import shutil
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("vime.export")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def write_hf_checkpoint(
    tensors: Mapping[str, torch.Tensor], base_model: str | Path, out: str | Path
) -> Path:
    """OUT/model.safetensors with `tensors`, beside the base model's config, generation config
    and tokenizer files (everything of it but its weights); return OUT."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for file in Path(base_model).iterdir():
        weights = file.suffix in WEIGHT_SUFFIXES or file.name.endswith(".index.json")
        if file.is_file() and not weights:
            shutil.copy(file, out / file.name)
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    save_file(contiguous, out / "model.safetensors", metadata={"format": "pt"})
    return out


def export(run_dir: str | Path, out: str | Path, checkpoint: str | Path | None = None) -> Path:
    """Write OUT/model.safetensors (+ the base model's other files); return OUT."""
    import torch.distributed as dist

    from vime.config import TrainConfig, latest_checkpoint
    from vime.megatron.checkpoint import load_checkpoint
    from vime.megatron.gather import GatherGroups, gather_hf_weights
    from vime.megatron.model import initialize_model_parallel
    from vime.trainer import MegatronTrainer

    run_dir, out = Path(run_dir), Path(out)
    resolved = run_dir / "config.resolved.json"
    if not resolved.is_file():
        raise SystemExit(f"vime export: {resolved} does not exist: give the run_dir of a vime job")
    config = TrainConfig.model_validate_json(resolved.read_text())
    path = Path(checkpoint) if checkpoint else latest_checkpoint(config.checkpoint.root(run_dir))
    if path is None or not (path / "metadata.json").is_file():
        raise SystemExit(
            f"vime export: no complete checkpoint at {path or config.checkpoint.root(run_dir)}: "
            "run the job with checkpoint.at_end (the default) or checkpoint.every_steps"
        )
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    try:
        topology = initialize_model_parallel(tp=1, pp=1, timeout=timedelta(minutes=10))
        trainer = MegatronTrainer(
            config.trainer.model_copy(update={"tensor_parallel_size": 1}),
            model_path=config.engine.model_path,
            topology=topology,
            grpo=config.grpo.model_copy(update={"kl_coef": 0.0}),
        )
        state = load_checkpoint(trainer, path, with_optimizer=False)
        tensors = {
            name: tensor.contiguous().clone()
            for name, tensor in gather_hf_weights(
                trainer.model,
                converter=trainer.converter,
                topology=topology,
                groups=GatherGroups.from_parallel_state(),
                timeout=timedelta(minutes=10),
            )
        }
    finally:
        dist.destroy_process_group()
    write_hf_checkpoint(tensors, config.engine.model_path, out)
    print(
        f"vime export: {path} (step {state.next_step}, weight version {state.weight_version}) "
        f"-> {out} ({len(tensors)} tensors)"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    from vime.utils.dist_env import default_to_single_process

    parser = argparse.ArgumentParser(prog="vime export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the job's run_dir (holds config.resolved.json)")
    parser.add_argument("out", help="directory to write the HF checkpoint to")
    parser.add_argument("--checkpoint", default=None, help="a step_<K> directory (default: newest)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    default_to_single_process()
    export(args.run_dir, args.out, args.checkpoint)


if __name__ == "__main__":
    main()
