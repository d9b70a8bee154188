"""The weight-sync wire format: how named tensors are laid out in flat byte buckets.

Defined once and used by both sides. The trainer calls `plan_buckets` on (name, dtype, shape)
triples and `pack`s each bucket into a uint8 buffer; the engine receives the same bucket
description as JSON (`Bucket.to_dict`) and `unpack`s the bytes into zero-copy views. Planning is a
pure function of its inputs, so two processes that plan the same list derive identical boundaries.

A bucket has a `mode`: "dense" (load what arrives), "full" (load it, and the engine keeps it as
the baseline of later deltas), "delta" (patches to that baseline: a dense replacement under its
name, or a sparse one as two entries, `<name>::indices` and `<name>::values`) and "commit" (the
delta is complete: load the whole patched baseline). See `vime.weight_sync.delta`.

Layout of one bucket: tensors in the given order, each starting at an offset rounded up to
`alignment` bytes (64 by default, so every view is aligned for any dtype and for vector loads);
padding bytes are zero. `alignment=1` gives the dense concatenation that vLLM's own packed NCCL and
IPC consumers read.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import xxhash

ALIGNMENT = 64
BUCKET_MODES = ("dense", "full", "delta", "commit")
# A kept bucket buffer (colocated shape) may go unused this many syncs in a row; the sync after
# drops it. Trainer and engine apply the same rule, `buffers_to_drop` (see
# vime.weight_sync.transports.colocated).
UNUSED_SYNCS_KEPT = 1

ParamSpec = tuple[str, "str | torch.dtype", Sequence[int]]
K = TypeVar("K")


def buffers_to_drop(kept: Iterable[K], used: Container[K], unused_syncs: dict[K, int]) -> list[K]:
    """At the end of a sync: the kept buffers (by key) that `UNUSED_SYNCS_KEPT` + 1 syncs in a row
    have not used, now to be dropped. `unused_syncs` counts, per key, the syncs in a row without
    it; it is updated here (a dropped key is forgotten)."""
    drop = []
    for key in list(kept):
        idle = 0 if key in used else unused_syncs.get(key, 0) + 1
        unused_syncs[key] = idle
        if idle > UNUSED_SYNCS_KEPT:
            del unused_syncs[key]
            drop.append(key)
    return drop


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the spelling used on the wire (and by vLLM's update infos)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype a wire dtype name stands for; ValueError for anything else."""
    if isinstance(name, str):
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise ValueError(f"unknown dtype name {name!r}; expected e.g. 'float32' or 'bfloat16'")


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in its bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """One flat byte buffer's worth of tensors; `nbytes` is the buffer size to send."""

    index: int
    tensors: tuple[TensorMeta, ...]
    nbytes: int
    mode: str = "dense"
    # A commit's tensors: those of the sender's pipeline stage, which the engine loads from its
    # patched baseline (another stage's tensors are its own commit's).
    commit_names: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def is_dense(self) -> bool:
        """True when the tensors are packed back to back with no padding (vLLM's packed layout)."""
        end = 0
        for meta in self.tensors:
            if meta.offset != end:
                return False
            end += meta.nbytes
        return end == self.nbytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description, column-wise like vLLM's update infos."""
        return {
            "index": self.index,
            "names": [t.name for t in self.tensors],
            "dtype_names": [t.dtype for t in self.tensors],
            "shapes": [list(t.shape) for t in self.tensors],
            "offsets": [t.offset for t in self.tensors],
            "nbytes": self.nbytes,
            "mode": self.mode,
            **({"commit_names": list(self.commit_names)} if self.mode == "commit" else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Bucket:
        """Parse and check a description from the wire (the receiver indexes memory by it)."""
        missing = {"index", "names", "dtype_names", "shapes", "offsets", "nbytes"} - set(data)
        if missing:
            raise ValueError(f"bucket description lacks {sorted(missing)}; got keys {sorted(data)}")
        names, dtypes, shapes, offsets = (
            data["names"],
            data["dtype_names"],
            data["shapes"],
            data["offsets"],
        )
        lengths = {len(names), len(dtypes), len(shapes), len(offsets)}
        if len(lengths) != 1:
            raise ValueError(
                f"bucket {data['index']}: names/dtype_names/shapes/offsets have lengths "
                f"{len(names)}/{len(dtypes)}/{len(shapes)}/{len(offsets)}; they must agree"
            )
        bucket_nbytes = int(data["nbytes"])
        metas = []
        end = 0
        for name, dtype, shape, offset in zip(names, dtypes, shapes, offsets, strict=True):
            shape = tuple(int(d) for d in shape)
            nbytes = _nbytes(name, dtype_from_name(dtype), shape)
            if offset < end:
                raise ValueError(
                    f"bucket {data['index']}: {name!r} at offset {offset} overlaps the previous "
                    f"tensor, which ends at {end}"
                )
            end = offset + nbytes
            metas.append(TensorMeta(name, dtype, shape, int(offset), nbytes))
        if end > bucket_nbytes:
            raise ValueError(
                f"bucket {data['index']}: tensors end at byte {end} but the bucket has "
                f"{bucket_nbytes} bytes"
            )
        mode = data.get("mode", "dense")
        if mode not in BUCKET_MODES:
            raise ValueError(f"bucket {data['index']}: mode {mode!r} is not one of {BUCKET_MODES}")
        commit_names = data.get("commit_names", [])
        if not isinstance(commit_names, list) or not all(isinstance(n, str) for n in commit_names):
            raise ValueError(f"bucket {data['index']}: commit_names must be a list of names")
        return cls(
            index=int(data["index"]),
            tensors=tuple(metas),
            nbytes=bucket_nbytes,
            mode=mode,
            commit_names=tuple(commit_names),
        )


def _nbytes(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor {name!r} has a negative dimension in shape {shape}")
    return math.prod(shape) * dtype.itemsize


def _as_spec(param: TensorMeta | ParamSpec) -> tuple[str, torch.dtype, tuple[int, ...]]:
    if isinstance(param, TensorMeta):
        name, dtype, shape = param.name, param.dtype, tuple(param.shape)
    else:
        if len(param) != 3:
            raise ValueError(f"expected (name, dtype, shape), got {param!r}")
        name, dtype, given_shape = param
        shape = tuple(given_shape)
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"tensor {name!r}: dtype must be a torch.dtype or its name, got {dtype!r}")
    return name, dtype, tuple(int(d) for d in shape)


def plan_buckets(
    params: Iterable[TensorMeta | ParamSpec],
    max_bucket_bytes: int,
    alignment: int = ALIGNMENT,
) -> list[Bucket]:
    """Split tensors, in the given order, into buckets of at most `max_bucket_bytes` each.

    Greedy and deterministic: a tensor goes into the current bucket if its aligned end stays
    within the cap, else it starts a new bucket. A tensor larger than the cap gets a bucket of its
    own. `params` are TensorMeta or (name, dtype | dtype name, shape) triples; names must be unique.
    """
    if max_bucket_bytes <= 0:
        raise ValueError(f"max_bucket_bytes must be positive, got {max_bucket_bytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a positive power of two, got {alignment}")
    buckets: list[Bucket] = []
    current: list[TensorMeta] = []
    end = 0
    seen: set[str] = set()

    def close() -> None:
        nonlocal current, end
        if current:
            buckets.append(Bucket(index=len(buckets), tensors=tuple(current), nbytes=end))
        current, end = [], 0

    for param in params:
        name, dtype, shape = _as_spec(param)
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice; names must be unique")
        seen.add(name)
        nbytes = _nbytes(name, dtype, shape)
        offset = _align_up(end, alignment)
        if current and offset + nbytes > max_bucket_bytes:
            close()
            offset = 0
        current.append(TensorMeta(name, dtype_name(dtype), shape, offset, nbytes))
        end = offset + nbytes
        if nbytes > max_bucket_bytes:
            close()
    close()
    return buckets


def _check_buffer(buffer: torch.Tensor, bucket: Bucket, what: str) -> None:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(
            f"{what} buffer must be a contiguous 1-D uint8 tensor, got dtype {buffer.dtype}, "
            f"shape {tuple(buffer.shape)}, contiguous={buffer.is_contiguous()}"
        )
    if buffer.numel() < bucket.nbytes:
        raise ValueError(
            f"{what} buffer has {buffer.numel()} bytes but bucket {bucket.index} needs "
            f"{bucket.nbytes}"
        )


def _view(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    chunk = buffer[meta.offset : meta.offset + meta.nbytes]
    return chunk.view(dtype_from_name(meta.dtype)).view(meta.shape)


def pack(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    bucket: Bucket,
    out: torch.Tensor,
) -> torch.Tensor:
    """Copy the bucket's tensors into `out` (uint8, at least bucket.nbytes) and return out[:nbytes].

    `tensors` may hold more than the bucket's tensors (e.g. a whole state dict); each of the
    bucket's names must be present with exactly the planned dtype and shape. Sources may live on
    another device or be non-contiguous: the copy handles both.
    """
    _check_buffer(out, bucket, "pack: output")
    by_name = tensors if isinstance(tensors, Mapping) else dict(tensors)
    end = 0
    for meta in bucket.tensors:
        if meta.name not in by_name:
            raise ValueError(f"pack: bucket {bucket.index} needs tensor {meta.name!r}, not given")
        tensor = by_name[meta.name]
        if dtype_name(tensor.dtype) != meta.dtype or tuple(tensor.shape) != meta.shape:
            raise ValueError(
                f"pack: tensor {meta.name!r} is {dtype_name(tensor.dtype)} {tuple(tensor.shape)} "
                f"but bucket {bucket.index} planned {meta.dtype} {meta.shape}"
            )
        if meta.offset > end:
            out[end : meta.offset].zero_()
        if meta.offset % tensor.element_size() == 0:
            _view(out, meta).copy_(tensor)
        else:  # a dense (alignment=1) bucket can leave a tensor unaligned: copy it as bytes
            raw = tensor.contiguous().reshape(-1).view(torch.uint8)
            out[meta.offset : meta.offset + meta.nbytes].copy_(raw)
        end = meta.offset + meta.nbytes
    return out[: bucket.nbytes]


def unpack(buffer: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy views of the bucket's tensors in `buffer`, in bucket order.

    The views alias `buffer`: whoever keeps one must keep the buffer's bytes unchanged.
    """
    _check_buffer(buffer, bucket, "unpack: input")
    for meta in bucket.tensors:
        if meta.offset % dtype_from_name(meta.dtype).itemsize:
            raise ValueError(
                f"unpack: {meta.name!r} ({meta.dtype}) starts at offset {meta.offset}, not a "
                f"multiple of its element size; plan with alignment >= 8 to get views"
            )
    return [(meta.name, _view(buffer, meta)) for meta in bucket.tensors]


# Sent dtype -> served dtypes the engine's loader reaches exactly (its copy_ upcasts). vLLM's CPU
# build serves some tensors of a bfloat16 model in float32 (e.g. Qwen2's q/k/v biases).
LOSSLESS_CASTS: dict[str, frozenset[str]] = {
    "bfloat16": frozenset({"float32", "float64"}),
    "float16": frozenset({"float32", "float64"}),
    "float32": frozenset({"float64"}),
}
# Float to narrower float, rounded to nearest as `Tensor.to` does: what Megatron's Float16Module
# does to fp32 parameters anyway. Anything else (to an integer dtype, fp16 <-> bf16) is refused.
ROUNDING_CASTS: dict[str, frozenset[str]] = {
    "float64": frozenset({"float32", "bfloat16", "float16"}),
    "float32": frozenset({"bfloat16", "float16"}),
}


def check_against_engine(
    params: Iterable[TensorMeta | ParamSpec],
    expected: Iterable[Mapping[str, Any]],
    *,
    allow_lossless_casts: bool = False,
    allow_rounding_casts: bool = False,
) -> None:
    """Raise ValueError unless `params` match what an engine expects, name for name.

    `expected` is the engine's answer to `vime_weight_metadata` ({"name", "dtype", "shape"} per
    tensor). Run it before moving any bytes: a wrong name or shape would otherwise surface as a
    failed load deep inside the engine, mid-update. With `allow_lossless_casts`, a tensor may be
    sent in a narrower float dtype than the engine serves (see LOSSLESS_CASTS): the served values
    then still equal the sent ones exactly. With `allow_rounding_casts`, a float tensor may be
    served narrower than the trainer holds it (see ROUNDING_CASTS): the sender casts it first.
    """
    ours = {name: (dtype_name(dtype), shape) for name, dtype, shape in map(_as_spec, params)}
    theirs = {e["name"]: (e["dtype"], tuple(e["shape"])) for e in expected}
    problems = []
    if missing := sorted(theirs.keys() - ours.keys()):
        problems.append(f"missing (the engine expects them): {missing[:10]}")
    if extra := sorted(ours.keys() - theirs.keys()):
        problems.append(f"unknown to the engine: {extra[:10]}")
    for name in sorted(ours.keys() & theirs.keys()):
        (our_dtype, our_shape), (their_dtype, their_shape) = ours[name], theirs[name]
        castable = (allow_lossless_casts and their_dtype in LOSSLESS_CASTS.get(our_dtype, ())) or (
            allow_rounding_casts and their_dtype in ROUNDING_CASTS.get(our_dtype, ())
        )
        if our_shape != their_shape or (our_dtype != their_dtype and not castable):
            problems.append(f"{name}: sending {ours[name]}, engine has {theirs[name]}")
    if problems:
        raise ValueError("weights do not match the engine's: " + "; ".join(problems[:20]))


def tensor_digest(tensor: torch.Tensor) -> str:
    """XXH3-128 hex of a tensor's bytes (row-major), computed on the trainer and engine alike.

    What it guarantees: equal bytes give equal digests, and a transfer or load that changed any
    byte (a wrong slice, a stale tensor, a dtype mix-up, a corrupted buffer) gives a different
    one except with probability ~2^-128. What it does not: it is no cryptographic hash; someone
    who controls the weights could construct two tensors with equal digests (the check guards
    against faults, not against an adversary). ~25 GB/s on one core here (sha256: ~2 GB/s).
    """
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_128_hexdigest(raw.numpy())


def take_bucket_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]], bucket: Bucket
) -> Iterator[tuple[str, torch.Tensor]]:
    """The bucket's tensors, pulled from a stream in plan order; ValueError on another name."""
    for meta in bucket.tensors:
        name, tensor = next(tensors)
        if name != meta.name:
            raise ValueError(
                f"the weights arrive with {name!r} where bucket {bucket.index} planned "
                f"{meta.name!r}: the stream and the bucket plan disagree on the order"
            )
        yield name, tensor
