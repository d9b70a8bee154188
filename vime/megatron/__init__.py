"""The trainer side of weight sync: a Megatron-core GPTModel built from an HF checkpoint.

- `topology`: where this rank sits in the tp/pp/dp/cp/ep mesh, and which rank sends per stage.
- `model`: build the GPTModel from an HF config, load the HF checkpoint, forward / log-probs.
- `converters`: Megatron <-> HF names and layouts, one registered class per HF architecture.
- `sharding`: full tensor <-> tensor-parallel shards (pure).
- `gather`: full HF-named tensors on each stage's sender, and their metadata without moving data.
- `cpu_shims`: what megatron-core needs to run without CUDA.

Submodules import megatron-core lazily, so `vime.megatron.converters` works without it.
"""
