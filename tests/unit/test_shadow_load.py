"""The parts of a load beside the served weights (`vime.weight_sync.engine.shadow`) that need no
vLLM engine: the structural copy, the memory estimate and the refusals. The load and swap
themselves run against real vLLM CPU engines in tests/distributed/test_real_model.py."""

from __future__ import annotations

import types

import pytest
import torch

from vime.weight_sync.engine import shadow, shadow_checks

pytestmark = pytest.mark.unit


class Block(torch.nn.Module):
    def __init__(self, shared: torch.nn.Module):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.shared = shared
        self.register_buffer("cache", torch.ones(3), persistent=False)


def test_the_copy_has_its_own_tables_one_copy_per_module_and_shares_the_tensors():
    shared = torch.nn.LayerNorm(4)
    model = torch.nn.Sequential(Block(shared), Block(shared))
    pairs: list = []
    twin = shadow._copy_tree(model, {}, pairs)
    assert len(pairs) == len(list(model.modules())) == 6  # the shared norm once
    assert twin[0].shared is twin[1].shared is not shared
    assert twin[0].proj.weight is model[0].proj.weight  # nothing copied yet
    twin[0].proj._parameters["weight"] = torch.nn.Parameter(torch.zeros(4, 4))
    twin[0]._buffers["cache"] = torch.zeros(3)
    assert model[0].proj.weight.abs().sum() > 0 and model[0].cache.sum() == 3


def test_the_swap_moves_tables_and_changed_attributes_but_keeps_children_and_side_buffers():
    live = Block(torch.nn.LayerNorm(4))
    live.kernel = "old"
    pairs: list = []
    twin = shadow._copy_tree(live, {}, pairs)
    new_weight = torch.nn.Parameter(torch.full((4, 4), 2.0))
    twin._parameters = {}  # a table of its own (as vLLM's processing leaves it)
    twin.__dict__["_parameters"] = {"w": new_weight}
    twin.kernel = "new"
    twin._buffers["cache"] = torch.zeros(3)  # non-persistent: not a weight, stays served
    shadow._swap_module(live, twin)
    assert live.w is new_weight and live.kernel == "new"
    assert live.cache.sum() == 3
    assert live.proj is not twin.proj  # children are swapped one by one, not here


def test_required_bytes_counts_each_tensor_once_and_repacked_kernels():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(4, 8))
    model[1].weight = model[0].weight  # tied (shape 4x8 on both: a transposed use is fine here)
    assert shadow_checks.required_bytes(model) == (4 * 8 + 8) * 4
    packed = torch.nn.Linear(16, 16)
    packed.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    packed.cpu_linear = lambda x, weight, bias: x
    packed.input_size_per_partition = packed.output_size_per_partition = 16
    assert shadow_checks.required_bytes(packed) == (16 + 16 * 16) * 4


def test_shadow_is_refused_off_cpu_without_eager_and_when_memory_is_short(monkeypatch):
    model = torch.nn.Linear(1024, 1024)
    eager = types.SimpleNamespace(enforce_eager=True)
    with pytest.raises(ValueError, match="CPU engines only.*weight_sync.shadow false"):
        shadow_checks.check_can_shadow(model, eager, "cuda:0")
    with pytest.raises(ValueError, match="enforce_eager"):
        shadow_checks.check_can_shadow(model, types.SimpleNamespace(enforce_eager=False), "cpu")
    monkeypatch.setattr(shadow_checks, "available_bytes", lambda: 1024**2)
    with pytest.raises(ValueError, match=r"needs 0\.00 GiB .* 0\.00 GiB is available"):
        shadow_checks.check_can_shadow(model, eager, "cpu")
    monkeypatch.setattr(shadow_checks, "available_bytes", lambda: 1024**3)
    assert shadow_checks.check_can_shadow(model, eager, "cpu") == (1024 * 1024 + 1024) * 4


def test_available_bytes_reads_this_machine():
    available = shadow_checks.available_bytes()
    assert available is None or available > 0
