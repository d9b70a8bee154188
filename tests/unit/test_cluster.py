"""The cluster section, node addresses, per-node commands and the rendered sbatch scripts."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from vime.cluster.addresses import check_reachable, node_address
from vime.cluster.node import ray_start_argv, trainer_argv
from vime.cluster.ray_cluster import JobIdentity, engine_bundle
from vime.cluster.slurm import fill, render
from vime.config import ClusterConfig, SlurmConfig, TrainConfig, load_config

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden")
WORKDIR = "/opt/vime"  # the rendered scripts' workdir, so the golden files hold no local path


def rendered(name: str, *overrides: str) -> str:
    config = load_config(TrainConfig, REPO_ROOT / "configs" / f"{name}.yaml", list(overrides))
    return render(
        config,
        config_path=f"{WORKDIR}/configs/{name}.yaml",
        overrides=list(overrides),
        workdir=WORKDIR,
    )


def bash_syntax_ok(text: str, tmp_path: Path) -> bool:
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    return subprocess.run(["bash", "-n", str(script)]).returncode == 0


@pytest.mark.parametrize(
    "name", ["slurm_gpu_colocated_ipc", "slurm_gpu_disaggregated_nccl", "slurm_cpu_2node"]
)
def test_rendered_script_matches_golden_and_parses(name, tmp_path):
    text = rendered(name)
    assert bash_syntax_ok(text, tmp_path)
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("VIME_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"re-render with VIME_UPDATE_GOLDEN=1 and review {golden}"


def test_gpu_colocated_layout():
    text = rendered("slurm_gpu_colocated_ipc")
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text
    assert "torchrun 2 x 8 = 16 ranks (TP 2, PP 1)" in text
    assert 'ENGINE_NODES=("${TRAINER_NODES[@]}")  # colocated' in text
    assert "16 vLLM engine(s) x TP 1 on the trainer nodes (colocated)" in text
    # Every step resolves its node address from the interface.
    assert text.count("--interface ib0") >= 4
    assert re.search(r"trainer --nnodes 2 \\\n\s+--nproc-per-node 8", text)
    assert "weight-sync group" not in text  # ipc: no broadcast group


def test_gpu_disaggregated_layout():
    text = rendered("slurm_gpu_disaggregated_nccl")
    assert "node 0: trainer, torchrun 1 x 8 = 8 ranks (TP 8, PP 1)" in text
    assert 'ENGINE_NODES=("${NODES[@]:1}")' in text
    assert "2 vLLM engine(s) x TP 4 on node 1" in text
    # 1 sender + 2 engines x 4 workers; engine e's workers from 1 + 4e.
    assert "world size 9 (sender rank 0), engine rank offsets [1, 5]" in text
    assert re.search(r"trainer --nnodes 1 \\\n\s+--nproc-per-node 8", text)
    assert "--engine-resource vime_engine_node" in text


def test_overrides_reach_the_trainer_quoted(tmp_path):
    text = rendered("slurm_cpu_2node", "num_steps=3", "run_dir=runs/a b")
    assert "OVERRIDES=(num_steps=3 'run_dir=runs/a b')" in text
    assert bash_syntax_ok(text, tmp_path)


def test_layout_errors_say_how_to_fix():
    with pytest.raises(
        ValueError, match="trainer_nodes=2 .colocated. or weight_sync.transport gloo"
    ):
        rendered("slurm_cpu_2node", "weight_sync.transport=shm")
    with pytest.raises(ValueError, match="STRICT_SPREAD"):
        rendered(
            "slurm_cpu_2node", "cluster.placement_strategy=STRICT_SPREAD", "engine.num_engines=2"
        )


def test_cluster_config_checks():
    with pytest.raises(ValueError, match="worker-port range"):
        SlurmConfig(ray_port=12000)
    with pytest.raises(ValueError, match="trainer_nodes=3 exceeds slurm.nodes=2"):
        SlurmConfig(nodes=2, trainer_nodes=3)
    with pytest.raises(ValueError, match="set cluster.interface"):
        ClusterConfig(node_address="10.0.0.5", slurm=SlurmConfig(nodes=2))
    assert ClusterConfig(job_id=1234).job_id == "1234"  # an override parses as an integer
    assert SlurmConfig(nodes=2, trainer_nodes=2).colocated
    assert SlurmConfig(gpus_per_node=8).procs_per_node == 8


def test_fill_rejects_missing_and_unused_values():
    assert fill("a {{x}} b", {"x": "1"}) == "a 1 b"
    with pytest.raises(KeyError, match="has no value"):
        fill("{{x}} {{y}}", {"x": "1"})
    with pytest.raises(KeyError, match="never used"):
        fill("{{x}}", {"x": "1", "z": "2"})


def test_node_address_order(monkeypatch):
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    monkeypatch.delenv("VIME_HOST_IP", raising=False)
    assert node_address() == "127.0.0.1"
    assert node_address(interface="lo") == "127.0.0.1"
    monkeypatch.setenv("VIME_HOST_IP", "127.0.0.3")
    assert node_address(interface="lo") == "127.0.0.3"
    assert node_address("127.0.0.9") == "127.0.0.9"
    with pytest.raises(ValueError, match="no such interface"):
        monkeypatch.delenv("VIME_HOST_IP")
        node_address(interface="no-such-if0")


def test_loopback_reaches_only_the_same_machine():
    check_reachable("127.0.0.2", "f", own_host="a", peer_hosts=["a", "a"])  # test nodes
    check_reachable("10.0.0.5", "f", own_host="a", peer_hosts=["b"])
    with pytest.raises(ValueError, match=r"cluster.node_address=127.0.0.1 is a loopback .*\['b'\]"):
        check_reachable("127.0.0.1", "cluster.node_address", own_host="a", peer_hosts=["b"])


def test_ray_start_commands():
    head = ray_start_argv(address="10.0.0.5", node_name="n1", head_port=6379, temp_dir="/tmp/r")
    assert head[:3] == ["ray", "start", "--block"]
    assert {"--head", "--port=6379", "--node-ip-address=10.0.0.5", "--temp-dir=/tmp/r"} <= set(head)
    assert '--resources={"vime_node:n1":1}' in head
    worker = ray_start_argv(
        address="10.0.0.6",
        node_name="n2",
        head_address="10.0.0.5:6379",
        engine_resource="vime_engine_node",
    )
    assert "--head" not in worker and "--address=10.0.0.5:6379" in worker
    assert '--resources={"vime_node:n2":1,"vime_engine_node":1000}' in worker
    with pytest.raises(ValueError):
        ray_start_argv(address="a", node_name="n", head_port=1, head_address="b:1")


def test_trainer_command_hosts_rendezvous_on_node_zero_only():
    argv = trainer_argv(
        address="10.0.0.5",
        nnodes=2,
        nproc_per_node=8,
        node_rank=0,
        rdzv_endpoint="10.0.0.5:29400",
        rdzv_id="77",
        train_args=["--config", "c.yaml"],
    )
    assert argv[0] == "torchrun" and "--nnodes=2" in argv and "--nproc-per-node=8" in argv
    assert "--rdzv-conf=is_host=1" in argv and "--local-addr=10.0.0.5" in argv
    assert argv[argv.index("-m") + 1 :] == ["vime.train", "--config", "c.yaml"]
    other = trainer_argv(
        address="10.0.0.6",
        nnodes=2,
        nproc_per_node=8,
        node_rank=1,
        rdzv_endpoint="10.0.0.5:29400",
        rdzv_id="77",
        train_args=[],
    )
    assert "--rdzv-conf=is_host=0" in other and "--node-rank=1" in other


def test_job_identity_and_engine_bundle(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    job = JobIdentity.from_config(ClusterConfig(job_name="exp"))
    assert job.namespace == "exp-4242" and job.engine_actor_name(3) == "exp-4242-engine-3"
    monkeypatch.delenv("SLURM_JOB_ID")
    first, second = (JobIdentity.from_config(ClusterConfig()) for _ in range(2))
    assert first.namespace != second.namespace  # two local runs never share names
    assert engine_bundle(ClusterConfig()) == {"CPU": 1.0, "vime_engine_node": 1}
    assert engine_bundle(
        ClusterConfig(engine_num_cpus=0, engine_num_gpus=4, engine_resource=None)
    ) == {"GPU": 4.0}


def test_a_ray_start_that_fails_before_the_node_started_is_retried(tmp_path, capsys):
    """`vime.cluster.node ray`: a start that ends before Ray reports it started is tried again
    (a fresh command line each time), up to the attempts given; one that started and then
    failed is not; the exit status is the last attempt's."""
    from vime.cluster.node import RAY_STARTED, run_ray

    count = tmp_path / "count"

    def script(body: str):
        def make_argv() -> list[str]:
            return ["bash", "-c", f'echo x >> "{count}"; n=$(wc -l < "{count}"); {body}']

        return make_argv

    # Fails twice without starting, then starts and blocks until it ends by itself.
    status = run_ray(script(f'[ "$n" -ge 3 ] && echo "{RAY_STARTED}" && exit 0; exit 7'), 3, 0)
    out = capsys.readouterr().out
    assert status == 0 and count.read_text().count("x") == 3
    assert out.count("ray start failed before the node started (exit status 7)") == 2
    assert "attempt 3/3" in out and RAY_STARTED in out
    count.unlink()
    # Never starts: gives up after the attempts, with the last status.
    assert run_ray(script("exit 5"), 2, 0) == 5 and count.read_text().count("x") == 2
    assert "ray start failed 2 times; giving up" in capsys.readouterr().out
    count.unlink()
    # Started, then died: not a start-up failure, not retried.
    assert run_ray(script(f'echo "{RAY_STARTED}"; exit 9'), 3, 0) == 9
    assert count.read_text().count("x") == 1
