"""A Megatron-core training loop of your own, with vime syncing every step into a vLLM engine.

    torchrun --nproc-per-node 2 examples/megatron_sft_loop.py --hf-dir models/qwen2-tiny \
        --out runs/example [--steps 4]

Nothing here is vime's trainer: megatron-core directly. A GPTModel built from the HF config with
megatron's own TransformerConfig and local layer spec (random init), wrapped as Megatron-LM wraps
it: Float16Module (bf16 parameters) inside DistributedDataParallel, megatron's distributed
optimizer (fp32 master weights sharded over the data-parallel ranks), megatron's forward/backward
schedule and finalize_model_grads. The two ranks are data-parallel. It runs a few supervised
steps on vime's digit-repeat demonstrations; vime launches one vLLM engine, takes the model's
weights before the first step and after every optimizer step (each sync's checksums compared
with the engine's), and greedy-generates through it with each token's weight version.

Rank 0 writes OUT/summary.json (per step: loss, sync seconds and bytes, the engine's greedy
tokens for each prompt and their weight versions) and OUT/hf/ (the trainer's final weights as an
HF checkpoint, for comparing the engine with HF transformers). The vime lines are marked `vime:`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from vime.plugin import EngineConfig, RolloutEngines, SamplingConfig, WeightSync, WeightSyncConfig

PROMPTS = ("Q: write 4 A:", "Q: 7 7 A:", "Q: 2 is the number A:")
SEQ_LEN = 24
BATCH_PER_RANK = 8


def build_model(hf_config) -> torch.nn.Module:
    """The GPTModel of a Qwen2 HF config, wrapped for bf16 and data parallelism."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,  # Qwen2
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        calculate_per_token_loss=True,
        # CPU: no fused kernels
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=hf_config.rope_parameters["rope_theta"],
        share_embeddings_and_output_weights=hf_config.tie_word_embeddings,
        parallel_output=True,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,  # vime gathers the params before it reads them
        average_in_collective=False,
    )
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    model.broadcast_params()
    config.finalize_model_grads_func = _finalize_model_grads
    config.no_sync_func, config.grad_sync_func = model.no_sync, model.start_grad_sync
    config.param_sync_func = model.start_param_sync
    return model


def _finalize_model_grads(*args, **kwargs):
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(*args, **kwargs)


def demonstrations(tokenizer, rank: int, world_size: int) -> list[list[int]]:
    """vime's digit-repeat demonstrations (prompt, completion, end of text) as token ids."""
    import vime

    path = Path(vime.__file__).parent / "data" / "digit_repeat" / "sft.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    samples = [
        tokenizer(r["prompt"])["input_ids"]
        + tokenizer(r["completion"])["input_ids"]
        + [tokenizer.eos_token_id]
        for r in records
    ]
    return [s[: SEQ_LEN + 1] for s in samples[rank::world_size]]


def batch(samples: list[list[int]], step: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[BATCH_PER_RANK, SEQ_LEN + 1] ids and a mask of the real next-token targets."""
    rows = [samples[(step * BATCH_PER_RANK + i) % len(samples)] for i in range(BATCH_PER_RANK)]
    ids = torch.full((len(rows), SEQ_LEN + 1), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), SEQ_LEN)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row) - 1] = 1.0
    return ids, mask


def train_step(model, optimizer, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """One optimizer step through megatron's schedule; the loss is summed over target tokens
    (megatron divides by the token count over DP, calculate_per_token_loss)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch_size = ids.shape[0]
    positions = torch.arange(SEQ_LEN).expand(batch_size, SEQ_LEN)
    causal = torch.triu(torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool), diagonal=1)[None, None]

    def forward_step(data_iterator, chunk):
        inputs, labels, loss_mask = next(data_iterator)
        per_token = chunk(inputs, positions, causal, labels=labels)  # [batch, seq] fp32 nll

        def loss_func(output):
            loss = (output.float() * loss_mask).sum()
            num_tokens = loss_mask.sum().to(torch.int)
            return loss, num_tokens, {"loss": torch.stack([loss.detach(), num_tokens.float()])}

        return per_token, loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    store = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([(ids[:, :-1], ids[:, 1:], mask)]),
        model=[model],
        num_microbatches=1,
        seq_length=SEQ_LEN,
        micro_batch_size=batch_size,
        forward_only=False,
    )
    optimizer.step()
    total = torch.stack([item["loss"] for item in store]).sum(0)
    dist.all_reduce(total)
    return float(total[0] / total[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True, help="HF checkpoint dir the engine serves")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    out = Path(args.out)

    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from transformers import AutoConfig, AutoTokenizer

    from vime.megatron.cpu_shims import apply_cpu_shims

    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    apply_cpu_shims()  # megatron-core on a CPU-only machine (a no-op with CUDA)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    hf_config = AutoConfig.from_pretrained(args.hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.hf_dir)
    model = build_model(hf_config)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", bf16=True, lr=args.lr, clip_grad=1.0, use_distributed_optimizer=True
        ),
        [model],
    )
    samples = demonstrations(tokenizer, rank, world_size)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    greedy = SamplingConfig(max_tokens=8, temperature=0.0, ignore_eos=True)

    # vime: one engine on the HF checkpoint; the sync's transport sets its backend.
    sync_config = WeightSyncConfig(transport="gloo", verify_checksums=True)
    engine = EngineConfig(model_path=args.hf_dir, max_model_len=256, max_num_seqs=8)
    engines = RolloutEngines.start(engine, weight_sync=sync_config, log_dir=out / "engine")
    try:
        # vime: the model as megatron hands it (DDP(Float16Module(GPTModel))), topology read
        # from parallel_state; the first sync puts the trainer's initial weights in the engine.
        sync = WeightSync([model], hf_path=args.hf_dir, engines=engines, config=sync_config)
        rows = []
        for step in range(args.steps + 1):
            loss = None
            if step > 0:
                ids, mask = batch(samples, step, tokenizer.eos_token_id)
                loss = train_step(model, optimizer, ids, mask)
            report = sync.update_weights()  # vime: every rank, after each optimizer step
            row = {
                "step": step,
                "loss": loss,
                "weight_version": sync.weight_version,
                "sync_s": report.total_s,
                "sync_bytes": report.num_bytes,
                "verified": report.verified,
            }
            if rank == 0:
                results = engines.generate(prompts, greedy)  # vime: per-token weight versions
                row["greedy"] = [r.token_ids for r in results]
                row["token_versions"] = [r.weight_versions for r in results]
                print(json.dumps(row), flush=True)
            rows.append(row)
        weights = sync.hf_state_dict()  # vime: the trainer's weights as HF tensors (rank 0)
        sync.close()
    finally:
        engines.shutdown()
    if rank == 0:
        from safetensors.torch import save_file

        hf_out = out / "hf"
        hf_out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, hf_out / "model.safetensors")
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if (Path(args.hf_dir) / name).exists():
                shutil.copy(Path(args.hf_dir) / name, hf_out / name)
        summary = {"prompts": prompts, "steps": rows, "world_size": world_size}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
