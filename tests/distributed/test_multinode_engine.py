"""One vLLM CPU engine spanning two nodes: TP=2, one worker on each, node 0 serving HTTP and
node 1 running `vllm serve --headless` (vime.engines.vllm_cli); the two "nodes" are this machine
at 127.0.0.2 and 127.0.0.3. The command lines are vime's own (build_server_command / launch_server).

Greedy output must equal HF transformers on the same checkpoint: the two workers really split the
model between them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from vime.config import EngineConfig
from vime.engines.server import launch_server
from vime.engines.server_command import EngineNodeRole
from vime.testing.hf import hf_greedy
from vime.utils.net import free_port

pytestmark = pytest.mark.distributed

NODE_0, NODE_1 = "127.0.0.2", "127.0.0.3"
PROMPT = [5, 17, 42, 7, 99, 3]
NUM_TOKENS = 12


def _node_config(model_dir: Path, node_rank: int) -> EngineConfig:
    return EngineConfig(
        model_path=str(model_dir),
        tensor_parallel_size=2,
        num_nodes=2,
        max_model_len=128,
        max_num_seqs=8,
        startup_timeout_s=400,
        # Both test nodes share this machine's cores: one each (real nodes keep "auto").
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(node_rank % os.cpu_count())},
    )


def test_tp2_engine_across_two_nodes_serves_exact_greedy(tiny_model_dir, tmp_path):
    master_port = free_port(NODE_0)
    servers = []
    try:
        # The headless node first: node 0's launch returns once the whole engine is healthy.
        for node_rank, address in ((1, NODE_1), (0, NODE_0)):
            server = launch_server(
                _node_config(tiny_model_dir, node_rank),
                host=address,
                port=None,
                log_path=tmp_path / f"node{node_rank}.log",
                node=EngineNodeRole(node_rank, 2, NODE_0, master_port),
            )
            servers.append(server)
        headless, node0 = servers
        assert node0.url.startswith(f"http://{NODE_0}:")
        assert headless.process.poll() is None, "the headless node exited"
        world = requests.get(f"{node0.url}/get_world_size", timeout=30).json()["world_size"]
        assert world == 2
        body = {
            "model": str(tiny_model_dir),
            "prompt": PROMPT,
            "max_tokens": NUM_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        response = requests.post(f"{node0.url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        tokens = response.json()["choices"][0]["token_ids"]
        assert tokens == hf_greedy(tiny_model_dir, PROMPT, NUM_TOKENS)
        assert "headless" in (tmp_path / "node1.log").read_text().lower()
    finally:
        for server in servers:
            server.stop()
