"""Engine side of vime's weight sync: the worker extension vLLM loads, which registers the backends.

Pass this module's class to the server and pick a backend:

    python -m vllm.entrypoints.openai.api_server --model DIR ... \\
        --worker-extension-cls vime.weight_sync.vllm_extension.VimeWorkerExtension \\
        --weight-transfer-config '{"backend": "vime_broadcast"}'   # or "vime_colocated"

vLLM workers import the extension class before `load_model`, which is when they create their
weight-transfer engine, so importing this module is enough to register the backends, one per sync
shape, each taking its device plug-in from the trainer's init_info (`vime.weight_sync.devices`):

- `vime_broadcast` (transport kinds gloo and nccl): the worker joins broadcast groups of its own
  (a TCPStore rendezvous with the trainer, never vLLM's default process group), one per trainer
  pipeline stage, keyed by `group_name`, and receives one broadcast per bucket
  (`engine.broadcast`).
- `vime_colocated` (shm and ipc): the worker opens the buffer a trainer rank on its own device
  filled (a shared-memory segment, a CUDA IPC handle), keeps it open for later syncs, and loads
  from it without copying it first (`engine.colocated`).

Both receive the bucket layout of `vime.weight_sync.buckets` and load through vLLM's layerwise
reload (start/finish wrap `initialize_layerwise_reload` / `finalize_layerwise_reload`), like
vLLM's own NCCL and IPC engines. On CPU a bucket's load runs on every core the server names in
`VIME_SYNC_LOAD_CORES` (`vime.weight_sync.engine.parallel_load`: whole decoder layers per thread).

`VimeWorkerExtension` adds methods callable through `POST /collective_rpc`:
`vime_weight_metadata` (HF names, dtypes and whole shapes the engine expects, and the slice each
worker holds, to check before sending), `vime_weight_checksums` (XXH3-128 of each worker's part of
every HF-named tensor, to check after), `vime_device_id` (the device a
colocated worker reads its buffers on) and
`vime_weight_update_stats` (where the last update's time went on the worker),
`vime_shadow_ready` (whether an update loading beside the served weights is ready to swap),
`vime_commit_between_steps[_available]` (answered by the engine core where vime's hook is
loaded, `engine.core_commit`: the swap and its label in one call; here only the answers for an
engine without it),
`vime_rebuild_tied_kernels` (after vLLM's own reload_weights: a tied head's CPU kernel) and
`vime_end_open_update` (ends an update a trainer that died mid-sync left open), and
`vime_peer_copy_source` / `vime_peer_copy_send` / `vime_peer_copy_receive` (a live engine
copies its weights to a joining one, `vime.weight_sync.engine.peer_copy`).
"""

from __future__ import annotations

import json
from typing import Any

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from vime.weight_sync.buckets import dtype_name, tensor_digest
from vime.weight_sync.engine.broadcast import BroadcastWeightTransferEngine
from vime.weight_sync.engine.colocated import ColocatedWeightTransferEngine
from vime.weight_sync.engine.core_commit import NOT_LOADED
from vime.weight_sync.engine.peer_copy import peer_copy_tensors, receive_peer_copy, send_peer_copy
from vime.weight_sync.engine.readback import record_load_digests, served_shards
from vime.weight_sync.names import BROADCAST_BACKEND, COLOCATED_BACKEND


class VimeWorkerExtension:
    """Mixed into vLLM's Worker by `--worker-extension-cls`; methods reachable by collective_rpc.

    Names start with `vime_` so they cannot clash with Worker attributes (vLLM rejects clashes).
    Each worker answers for its own part of the model; /collective_rpc returns one result per
    worker.
    """

    def vime_weight_metadata(self) -> list[dict[str, Any]]:
        """[{"name", "dtype", "shape", "shard"}] of every weight this worker serves, under HF
        names: "shape" is the whole tensor's, "shard" the [dim, start, stop] slice of it this
        worker holds (None: all of it)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return [
            {
                "name": served.name,
                "dtype": dtype_name(served.tensor.dtype),
                "shape": list(served.shape),
                "shard": None if served.shard is None else served.shard.to_list(),
            }
            for served in served_shards(model, materialize=False)
        ]

    def vime_device_id(self) -> str:
        """This worker's device id (`vime.weight_sync.devices.device_id`): "cuda:<GPU UUID>",
        or on CPU "cpu" / "cpu:<n>" (from the server's VIME_DEVICE_IDS)."""
        import torch

        from vime.weight_sync.devices import device_id

        return device_id(torch.device(self.device), self.parallel_config.rank)  # type: ignore[attr-defined]

    def vime_weight_update_stats(self) -> dict[str, float]:
        """This worker's `stats` of its last weight update (empty before the first one)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "stats", {}))

    def vime_shadow_ready(self, wait_s: str = "0") -> dict[str, Any]:
        """With weight_sync.shadow: no more buckets for the open update; {"ready": its load
        beside the served weights is done, "error": why it failed, or None}, after waiting up
        to `wait_s` seconds (a string: /collective_rpc passes strings)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "shadow_status"):
            return {"ready": False, "error": "this engine has no vime weight-transfer backend"}
        return engine.shadow_status(float(wait_s))

    # Answered by the engine core itself where vime's hook is loaded (`engine.core_commit`); these
    # two run only where it is not.
    def vime_commit_between_steps_available(self) -> dict[str, Any]:
        """{"available": False}: this engine cannot swap and label in one engine-core call."""
        return {"available": False, "why": NOT_LOADED}

    def vime_commit_between_steps(self, **kwargs: str) -> dict[str, Any]:
        raise RuntimeError(NOT_LOADED)

    def vime_rebuild_tied_kernels(self) -> dict[str, int]:
        """After vLLM's own `reload_weights` on CPU: rebuild the kernel of a head tied to the
        embedding, which that reload leaves packed from the old embedding (vime's updates do
        it themselves, `engine.base.refresh_tied_kernels`). {"rebuilt": how many}."""
        import torch

        from vime.weight_sync.engine.base import refresh_tied_kernels

        if torch.accelerator.is_available():
            return {"rebuilt": 0}
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {"rebuilt": refresh_tied_kernels(model)}

    def vime_end_open_update(self) -> dict[str, bool]:
        """End a weight update left open (its trainer died between start and finish): vLLM
        refuses a new start while one is open. Layers that got no weights keep their previous
        tensors (with weight_sync.shadow none is swapped in: the copy is dropped); the engine's
        weight version label is unchanged. {"ended": whether one was open} (a dict:
        /collective_rpc turns a bare bool into the string "False")."""
        if not getattr(self, "_weight_update_active", False):
            return {"ended": False}
        drop_shadow = getattr(getattr(self, "weight_transfer_engine", None), "_drop_shadow", None)
        if drop_shadow is not None:
            drop_shadow()
        self.finish_weight_update()  # type: ignore[attr-defined]
        return {"ended": True}

    def vime_peer_copy_source(self) -> dict[str, Any]:
        """Worker 0: the tensors this engine can copy to a joiner (`engine.peer_copy`)."""
        return peer_copy_tensors(self.weight_transfer_engine, self.parallel_config)  # type: ignore[attr-defined]

    def vime_peer_copy_send(self, info: str) -> dict[str, float]:
        """Worker 0: send them to a joining engine's workers (`engine.peer_copy`; JSON `info`)."""
        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        return send_peer_copy(engine, self.parallel_config, json.loads(info))  # type: ignore[attr-defined]

    def vime_peer_copy_receive(self, info: str) -> dict[str, float]:
        """Every worker of a joining engine: receive and load a live engine's weights (`info`
        is JSON)."""
        return receive_peer_copy(self, json.loads(info))

    def vime_weight_checksums(self, source: str = "served") -> dict[str, str]:
        """{HF name: XXH3-128 hex of this worker's part's bytes} for every weight it serves.

        source "served": every weight read back as served (repacked CPU linear weights through
        their kernels); "loaded": those taken as their layer was last loaded, just before the
        repack (`engine.readback.record_load_digests`; the rest read as served).
        """
        if source not in ("served", "loaded"):
            raise ValueError(f"source must be 'served' or 'loaded', got {source!r}")
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {
            served.name: served.digest or tensor_digest(served.tensor)
            for served in served_shards(model, loaded_digests=source == "loaded")
        }


def register_backends() -> None:
    """Register the vime backends with vLLM's factory (idempotent)."""
    for name, engine_cls in (
        (BROADCAST_BACKEND, BroadcastWeightTransferEngine),
        (COLOCATED_BACKEND, ColocatedWeightTransferEngine),
    ):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, engine_cls)


register_backends()
record_load_digests()
