"""Real megatron-core on gloo: load HF checkpoints, gather them back, run the forward.

For each parallel layout, every tiny architecture (float32 and bfloat16, plus a tied-embedding
Qwen2) is built, loaded from its HF checkpoint and gathered back to HF names on the pp senders;
the gathered state dict must equal the checkpoint bit for bit and match the stage metadata each
rank lists without communication. At PP=1 the Megatron logits and log-probs must match HF
transformers on the same weights. The Transformer Engine layout (fused norms, grouped experts)
is checked by names: the same models seen through `te_names.TENamedModel` must gather to the
same tensors bit for bit (TP1/TP2, PP1/PP2, EP2; never run with Transformer Engine).

    pytest -m distributed tests/distributed/test_megatron_model.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_harness import Case, Job, build_tied_variant, run_workers
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

DENSE_PRESETS = ("qwen2-tiny", "qwen3-tiny", "llama-tiny", "mistral-tiny")
MOE_PRESET = "qwen3-moe-tiny"
SHARED_EXPERT_PRESET = "qwen2-moe-tiny"  # routed experts + a gated shared expert
DTYPES = ("float32", "bfloat16")
INPUT_IDS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def models(model_builder, tmp_path_factory) -> dict[tuple[str, str], str]:
    """(preset, dtype) -> checkpoint dir; preset "qwen2-tied" is the tied-embedding Qwen2."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for preset in (*DENSE_PRESETS, MOE_PRESET, SHARED_EXPERT_PRESET):
        for dtype in DTYPES:
            dirs[preset, dtype] = str(model_builder(preset, dtype))
    for dtype in DTYPES:
        src = Path(dirs["qwen2-tiny", dtype])
        dirs["qwen2-tied", dtype] = str(build_tied_variant(src, root / f"qwen2-tied-{dtype}"))
    return dirs


@pytest.fixture(scope="module")
def hf_logits(models) -> dict[str, torch.Tensor]:
    """HF transformers float32 logits on INPUT_IDS, per preset."""
    from transformers import AutoModelForCausalLM

    logits = {}
    for (preset, dtype), model_dir in models.items():
        if dtype == "float32":
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                logits[preset] = model(INPUT_IDS).logits
    return logits


# Presets also gathered through the Transformer Engine names view (bfloat16 only).
TE_PRESETS = ("qwen2-tiny", "qwen3-tiny", "qwen2-tied", MOE_PRESET, SHARED_EXPERT_PRESET)


def _cases(models, presets, *, forward: bool) -> tuple[Case, ...]:
    cases = tuple(
        Case(models[preset, dtype], dtype, forward=forward and dtype == "float32")
        for preset in presets
        for dtype in DTYPES
    )
    te = tuple(
        Case(models[preset, "bfloat16"], "bfloat16", te_names=True)
        for preset in presets
        if preset in TE_PRESETS
    )
    return cases + te


ALL_PRESETS = (*DENSE_PRESETS, "qwen2-tied", MOE_PRESET, SHARED_EXPERT_PRESET)
MOE_PRESETS = (MOE_PRESET, SHARED_EXPERT_PRESET)
# (id, world_size, job kwargs, presets, run forward)
LAYOUTS = [
    ("tp1pp1", 1, {}, ALL_PRESETS, True),
    ("tp2pp1", 2, {"tp": 2}, ALL_PRESETS, True),
    ("tp1pp2", 2, {"pp": 2}, ALL_PRESETS, False),
    ("ep2", 2, {"ep": 2}, MOE_PRESETS, True),
    ("tp2pp2", 4, {"tp": 2, "pp": 2}, ("qwen2-tied", *MOE_PRESETS), False),
    ("tp2ep2", 4, {"tp": 2, "ep": 2}, MOE_PRESETS, False),
]


def _assert_gathered_equals_checkpoint(
    results: list, key: tuple[str, str, bool], pp_size: int
) -> None:
    senders = [r for r in results if r["topology"].is_pp_sender]
    assert sorted(r["topology"].pp_rank for r in senders) == list(range(pp_size))
    for r in results:
        if not r["topology"].is_pp_sender:
            assert r["cases"][key]["gathered"] == [], "non-senders must yield nothing"
    gathered = [
        pair
        for r in sorted(senders, key=lambda r: r["topology"].pp_rank)
        for pair in r["cases"][key]["gathered"]
    ]
    for r in results:
        # Every rank of a stage lists what its sender sends, in sending order.
        sender = next(s for s in senders if s["topology"].pp_rank == r["topology"].pp_rank)
        metadata = r["cases"][key]["stage_metadata"]
        assert metadata == sender["cases"][key]["stage_metadata"], "stage ranks disagree"
        assert {m.pp_stage for m in metadata} == {r["topology"].pp_rank}
        assert [(m.name, m.dtype, m.shape) for m in metadata] == [
            (name, t.dtype, tuple(t.shape)) for name, t in sender["cases"][key]["gathered"]
        ]

    checkpoint = load_file(Path(key[0]) / "model.safetensors")
    names = [name for name, _ in gathered]
    assert len(names) == len(set(names)), "a tensor was sent twice"
    assert sorted(names) == sorted(checkpoint)
    for name, tensor in gathered:
        expected = checkpoint[name]
        assert tensor.dtype == expected.dtype, name
        assert torch.equal(tensor, expected), f"{name} differs from the checkpoint"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world_size", "job_kwargs", "presets", "forward"),
    [pytest.param(*layout[1:], id=layout[0]) for layout in LAYOUTS],
)
def test_load_gather_roundtrip_and_logits(
    models, hf_logits, tmp_path, world_size, job_kwargs, presets, forward
):
    job = Job(
        **job_kwargs,
        cases=_cases(models, presets, forward=forward),
        input_ids=tuple(map(tuple, INPUT_IDS.tolist())),
    )
    results = run_workers(job, world_size, tmp_path)

    for r in results:
        assert r["topology"] == r["expected_topology"]
    for case in job.cases:
        key = (case.model_dir, case.dtype, case.te_names)
        _assert_gathered_equals_checkpoint(results, key, job.pp)
        if case.te_names:
            # The view really had TE's names, and the plan saw that layout.
            names = results[0]["cases"][key]["names"]
            assert any(n.endswith("linear_qkv.layer_norm_weight") for n in names)
            assert not any(n.endswith("input_layernorm.weight") for n in names)
            if any(".mlp.router." in n for n in names):  # TEGroupedMLP's expert names
                assert any(".mlp.experts.linear_fc1.weight0" in n for n in names)
                assert not any(".local_experts." in n for n in names)
            assert results[0]["cases"][key]["layout"] == "transformer_engine"
            local = results[0]["cases"][key[:2] + (False,)]
            assert local["layout"] == "local"
        if not case.forward:
            continue
        preset = next(p for (p, d), path in models.items() if path == case.model_dir)
        reference = hf_logits[preset]
        reference_logprobs = torch.log_softmax(reference, dim=-1)[:, :-1]
        reference_logprobs = reference_logprobs.gather(-1, INPUT_IDS[:, 1:, None])[..., 0]
        for r in results:
            logits = r["cases"][key]["logits"]
            assert logits.shape == reference.shape
            torch.testing.assert_close(logits, reference, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(
                r["cases"][key]["logprobs"], reference_logprobs, atol=2e-5, rtol=1e-4
            )
