"""The weight-sync wire format: planning, packing, unpacking, and the GPU transports' payloads."""

from __future__ import annotations

import json

import pytest
import torch

from vime.weight_sync.buckets import (
    ALIGNMENT,
    Bucket,
    buffers_to_drop,
    check_against_engine,
    pack,
    plan_buckets,
    tensor_digest,
    unpack,
)

pytestmark = pytest.mark.unit


def _state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 16, generator=generator),
        "layers.0.norm.weight": torch.randn(16, generator=generator).to(torch.bfloat16),
        "layers.0.proj.weight": torch.randn(5, 3, generator=generator).to(torch.float16),
        "layers.0.proj.bias": torch.randn(5, generator=generator).to(torch.bfloat16),
        "layers.0.step": torch.tensor(7, dtype=torch.int64),
        "layers.0.mask": torch.randint(0, 2, (3, 3), generator=generator).to(torch.bool),
        "layers.0.ids": torch.randint(-100, 100, (11,), generator=generator).to(torch.int32),
        "layers.1.scale": torch.randn(2, 2, generator=generator, dtype=torch.float64),
        "layers.1.empty": torch.empty(0, 4),
        "head.weight": torch.randn(64, 16, generator=generator),
    }


def _specs(state_dict: dict[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(name, t.dtype, tuple(t.shape)) for name, t in state_dict.items()]


def _round_trip(state_dict, buckets) -> dict[str, torch.Tensor]:
    received = {}
    for bucket in buckets:
        buffer = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8)
        packed = pack(state_dict, bucket, buffer)
        assert packed.numel() == bucket.nbytes
        wire = Bucket.from_dict(json.loads(json.dumps(bucket.to_dict())))
        received.update(unpack(buffer.clone(), wire))
    return received


def test_planning_is_deterministic_and_ordered():
    specs = _specs(_state_dict())
    first = plan_buckets(specs, max_bucket_bytes=1024)
    second = plan_buckets(list(specs), max_bucket_bytes=1024)
    assert first == second
    assert [b.to_dict() for b in first] == [b.to_dict() for b in second]
    assert [n for b in first for n in b.names] == [s[0] for s in specs]
    assert [b.index for b in first] == list(range(len(first)))
    # dtype names and torch dtypes plan alike
    by_name = [(n, str(d).removeprefix("torch."), s) for n, d, s in specs]
    assert plan_buckets(by_name, max_bucket_bytes=1024) == first


def test_cap_respected_offsets_aligned_and_disjoint():
    state_dict = _state_dict()
    cap = 1024
    buckets = plan_buckets(_specs(state_dict), max_bucket_bytes=cap)
    assert len(buckets) > 1
    for bucket in buckets:
        assert bucket.nbytes <= cap or len(bucket.tensors) == 1
        end = 0
        for meta in bucket.tensors:
            assert meta.offset % ALIGNMENT == 0
            assert meta.offset >= end
            end = meta.offset + meta.nbytes
            assert meta.nbytes == state_dict[meta.name].numel() * state_dict[meta.name].itemsize
        assert end == bucket.nbytes


def test_oversize_tensor_gets_its_own_bucket():
    specs = [("a", "float32", (10,)), ("big", "float32", (1000,)), ("b", "float32", (10,))]
    buckets = plan_buckets(specs, max_bucket_bytes=256)
    assert [b.names for b in buckets] == [["a"], ["big"], ["b"]]
    assert buckets[1].nbytes == 4000
    assert buckets[1].tensors[0].offset == 0


def test_dense_alignment_packs_back_to_back():
    specs = [("a", "bfloat16", (3,)), ("b", "float32", (2,)), ("c", "int8", (5,))]
    (bucket,) = plan_buckets(specs, max_bucket_bytes=1 << 20, alignment=1)
    assert [t.offset for t in bucket.tensors] == [0, 6, 14]
    assert bucket.nbytes == 19 and bucket.is_dense()
    (aligned,) = plan_buckets(specs, max_bucket_bytes=1 << 20)
    assert not aligned.is_dense()


@pytest.mark.parametrize("cap", [64, 1000, 1 << 20])
def test_round_trip_is_bit_exact(cap):
    state_dict = _state_dict()
    received = _round_trip(state_dict, plan_buckets(_specs(state_dict), max_bucket_bytes=cap))
    assert list(received) == list(state_dict)
    for name, tensor in state_dict.items():
        got = received[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert tensor_digest(got) == tensor_digest(tensor), name


def test_round_trip_of_non_contiguous_and_nan_payloads():
    source = torch.randn(8, 6).to(torch.bfloat16)
    source[0, 0] = float("nan")
    state_dict = {"t": source.t(), "u": torch.arange(12, dtype=torch.int64).view(3, 4)[:, ::2]}
    buckets = plan_buckets(_specs(state_dict), max_bucket_bytes=1 << 20)
    received = _round_trip(state_dict, buckets)
    for name, tensor in state_dict.items():
        assert tensor_digest(received[name]) == tensor_digest(tensor)


def test_dense_bucket_packs_unaligned_tensors_as_bytes():
    state_dict = {"a": torch.randn(3).to(torch.bfloat16), "b": torch.randn(2)}
    (bucket,) = plan_buckets(_specs(state_dict), max_bucket_bytes=1 << 20, alignment=1)
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack(state_dict, bucket, buffer)
    b_bytes = buffer[6:14].clone()
    assert torch.equal(b_bytes.view(torch.float32), state_dict["b"])
    with pytest.raises(ValueError, match="alignment"):
        unpack(buffer, bucket)


def test_unpack_returns_views_of_the_buffer():
    state_dict = {"w": torch.randn(4, 4), "v": torch.randn(3).to(torch.bfloat16)}
    (bucket,) = plan_buckets(_specs(state_dict), max_bucket_bytes=1 << 20)
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack(state_dict, bucket, buffer)
    views = dict(unpack(buffer, bucket))
    for meta in bucket.tensors:
        assert views[meta.name].data_ptr() == buffer.data_ptr() + meta.offset
    buffer.zero_()
    assert not views["w"].any()


def test_padding_bytes_are_zeroed():
    state_dict = {"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(3, dtype=torch.int8)}
    (bucket,) = plan_buckets(_specs(state_dict), max_bucket_bytes=1 << 20)
    buffer = torch.full((bucket.nbytes + 10,), 0xFF, dtype=torch.uint8)
    pack(state_dict, bucket, buffer)
    assert buffer[3:ALIGNMENT].eq(0).all()
    assert buffer[bucket.nbytes :].eq(0xFF).all()  # nothing written past the bucket


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="max_bucket_bytes"):
        plan_buckets([("a", "float32", (1,))], max_bucket_bytes=0)
    with pytest.raises(ValueError, match="power of two"):
        plan_buckets([("a", "float32", (1,))], max_bucket_bytes=64, alignment=48)
    with pytest.raises(ValueError, match="twice"):
        plan_buckets([("a", "float32", (1,)), ("a", "float32", (2,))], max_bucket_bytes=64)
    with pytest.raises(ValueError, match="unknown dtype"):
        plan_buckets([("a", "float33", (1,))], max_bucket_bytes=64)
    with pytest.raises(ValueError, match="unknown dtype"):
        plan_buckets([("a", "Tensor", (1,))], max_bucket_bytes=64)
    with pytest.raises(ValueError, match="negative"):
        plan_buckets([("a", "float32", (-1, 2))], max_bucket_bytes=64)
    with pytest.raises(ValueError, match="name"):
        plan_buckets([("", "float32", (1,))], max_bucket_bytes=64)
    with pytest.raises(TypeError, match="dtype"):
        plan_buckets([("a", 3, (1,))], max_bucket_bytes=64)


def test_pack_and_unpack_reject_mismatches():
    state_dict = {"w": torch.randn(4, 4)}
    (bucket,) = plan_buckets(_specs(state_dict), max_bucket_bytes=1 << 20)
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs tensor 'w'"):
        pack({}, bucket, buffer)
    with pytest.raises(ValueError, match=r"float64 \(4, 4\)"):
        pack({"w": torch.randn(4, 4, dtype=torch.float64)}, bucket, buffer)
    with pytest.raises(ValueError, match=r"\(4, 3\)"):
        pack({"w": torch.randn(4, 3)}, bucket, buffer)
    with pytest.raises(ValueError, match="needs 64"):
        pack(state_dict, bucket, torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack(state_dict, bucket, torch.zeros(64, dtype=torch.float32))
    with pytest.raises(ValueError, match="needs 64"):
        unpack(torch.zeros(63, dtype=torch.uint8), bucket)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        unpack(torch.zeros(2, 64, dtype=torch.uint8), bucket)


def test_from_dict_rejects_inconsistent_descriptions():
    specs = [("a", "float32", (4,)), ("b", "float32", (4,))]
    good = plan_buckets(specs, max_bucket_bytes=1 << 20)[0].to_dict()
    with pytest.raises(ValueError, match="lacks"):
        Bucket.from_dict({k: v for k, v in good.items() if k != "offsets"})
    with pytest.raises(ValueError, match="lengths"):
        Bucket.from_dict({**good, "names": ["a"]})
    with pytest.raises(ValueError, match="overlaps"):
        Bucket.from_dict({**good, "offsets": [0, 8]})
    with pytest.raises(ValueError, match="bucket has"):
        Bucket.from_dict({**good, "nbytes": 70})
    with pytest.raises(ValueError, match="unknown dtype"):
        Bucket.from_dict({**good, "dtype_names": ["float32", "nope"]})


def test_check_against_engine_names_every_problem():
    expected = [
        {"name": "a", "dtype": "float32", "shape": [2, 3]},
        {"name": "b", "dtype": "bfloat16", "shape": [4]},
        {"name": "c", "dtype": "float32", "shape": [1]},
    ]
    check_against_engine(
        [("a", torch.float32, (2, 3)), ("b", "bfloat16", (4,)), ("c", "float32", [1])], expected
    )
    with pytest.raises(ValueError) as excinfo:
        check_against_engine(
            [("a", torch.float32, (3, 2)), ("b", torch.float32, (4,)), ("d", "float32", (1,))],
            expected,
        )
    message = str(excinfo.value)
    assert "missing" in message and "'c'" in message
    assert "unknown to the engine" in message and "'d'" in message
    assert "(3, 2)" in message and "bfloat16" in message


def test_check_against_engine_allows_only_lossless_casts_when_asked():
    expected = [{"name": "bias", "dtype": "float32", "shape": [4]}]
    narrower = [("bias", torch.bfloat16, (4,))]
    with pytest.raises(ValueError, match="bias"):
        check_against_engine(narrower, expected)
    check_against_engine(narrower, expected, allow_lossless_casts=True)
    wider = [{"name": "bias", "dtype": "bfloat16", "shape": [4]}]
    with pytest.raises(ValueError, match="sending"):  # float32 -> bfloat16 would round
        check_against_engine([("bias", torch.float32, (4,))], wider, allow_lossless_casts=True)


def test_every_transport_aligns_each_tensor_for_its_dtype():
    """An odd-sized bfloat16 tensor before a float32 one: a dense concatenation puts the float32
    at an offset vLLM's own unpack cannot view ("storage_offset() must be divisible by 4"); every
    vime transport plans aligned buckets, so each view is valid and exact."""
    from vime.weight_sync.transports.broadcast import BroadcastTransport
    from vime.weight_sync.transports.colocated import ColocatedTransport

    state_dict = {"odd": torch.randn(3).to(torch.bfloat16), "w": torch.randn(5)}
    for transport in (BroadcastTransport, ColocatedTransport):
        assert transport.alignment % 4 == 0
        (bucket,) = plan_buckets(_specs(state_dict), 1 << 20, alignment=transport.alignment)
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack(state_dict, bucket, buffer)
        for name, view in unpack(buffer, bucket):
            assert view.storage_offset() % view.element_size() == 0
            assert torch.equal(view, state_dict[name])


# ---- the dense layout (alignment=1) vLLM's own packed consumers read -------------------------


def test_dense_bucket_matches_vllm_packed_layout():
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    state_dict = {
        "w": torch.randn(4, 6),
        "b": torch.randn(6).to(torch.bfloat16),
        "v": torch.randn(8),
    }
    (bucket,) = plan_buckets(_specs(state_dict), max_bucket_bytes=1 << 20, alignment=1)
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack(state_dict, bucket, buffer)
    reference = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in state_dict.values()])
    assert torch.equal(buffer, reference)
    described = bucket.to_dict()
    unpacked = unpack_tensor(
        buffer,
        described["names"],
        described["shapes"],
        [t.dtype for t in state_dict.values()],
        [t.nbytes for t in bucket.tensors],
    )
    for name, tensor in unpacked:
        assert tensor_digest(tensor) == tensor_digest(state_dict[name])


def test_rounding_casts_only_float_to_narrower_float_when_asked():
    fp32 = [("w", torch.float32, (4,))]
    engine_bf16 = [{"name": "w", "dtype": "bfloat16", "shape": [4]}]
    with pytest.raises(ValueError, match="sending"):
        check_against_engine(fp32, engine_bf16, allow_lossless_casts=True)
    check_against_engine(fp32, engine_bf16, allow_rounding_casts=True)
    for served in ("int8", "float64"):  # an integer dtype, or wider: never a rounding cast
        with pytest.raises(ValueError, match="sending"):
            check_against_engine(
                fp32, [{"name": "w", "dtype": served, "shape": [4]}], allow_rounding_casts=True
            )
    with pytest.raises(ValueError, match="sending"):  # fp16 <-> bf16 loses range or precision
        check_against_engine([("w", torch.float16, (4,))], engine_bf16, allow_rounding_casts=True)


def test_wire_dtypes_cast_only_what_an_engine_serves_narrower():
    from vime.megatron.gather import HFWeightMeta
    from vime.weight_sync.checks import wire_dtypes

    metadata = [
        HFWeightMeta("w", torch.float32, (4,), 0),
        HFWeightMeta("norm", torch.float32, (4,), 0),
        HFWeightMeta("b", torch.bfloat16, (4,), 0),
    ]
    layouts = [[{"w": ("bfloat16", None), "norm": ("float32", None), "b": ("float32", None)}]]
    assert wire_dtypes(metadata, layouts) == {"w": torch.bfloat16}


def test_a_buffer_is_dropped_after_two_syncs_in_a_row_without_it():
    """The rule both sides of the colocated shape apply to their kept buffers."""
    unused: dict[int, int] = {}
    kept = {0, 1, 2}
    assert buffers_to_drop(kept, {0, 1, 2}, unused) == []  # a full sync
    assert buffers_to_drop(kept, {0, 1}, unused) == []  # 2 unused once: kept
    assert buffers_to_drop(kept, {0, 2}, unused) == []  # 2 used again, 1 unused once
    assert buffers_to_drop(kept, {0}, unused) == [1]  # 1 unused twice in a row; 2 once
    assert unused == {0: 0, 2: 1}
