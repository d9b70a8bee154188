"""A real multi-node job: `vime slurm` renders it, a two-node Slurm cluster on this machine runs it.

Node vime-n1 (127.0.0.2) runs the Ray head and the trainer; vime-n2 (127.0.0.3) a Ray worker and
the one vLLM CPU engine; the weights cross by gloo broadcast from the trainer's node. Everything
binds to and talks over those loopback addresses only. The engine on the other node dies once
(EngineCore SIGKILLed after the first step) and, with fault tolerance, is restarted there, synced
(checksums) and serves again: the faults tier's engine on another node. A second engine joins
on vime-n2 while the job runs, its weights copied engine to engine (the elastic fleet across nodes).
vime-n2's first `ray start` fails (as when GCS cannot find a new node) and is retried.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_harness import (
    NODE_ADDRESSES,
    REPO_ROOT,
    processes_of_job,
    start_cluster,
    stop_cluster,
)

from vime.utils.net import free_port

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def slurm():
    env = start_cluster()
    yield env
    stop_cluster()


def _kill_engine_core_after_first_step(run_dir: Path, job: subprocess.Popen) -> int | None:
    """SIGKILL the engine's EngineCore once a step is logged; its pid (None: the job ended)."""
    metrics, log = run_dir / "metrics.jsonl", run_dir / "engines" / "vllm-engine-0.log"
    deadline = time.monotonic() + 600
    while job.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().strip():
            (pid, *_) = reversed(re.findall(r"\(EngineCore pid=(\d+)\)", log.read_text()))
            os.kill(int(pid), signal.SIGKILL)
            return int(pid)
        time.sleep(0.1)
    return None


@pytest.mark.faults
def test_two_node_slurm_job_trains_on_one_node_and_serves_on_the_other(
    slurm, tmp_path, tiny_model_dir
):
    num_steps = 20  # steps take ~0.2 s here: the kill must land before the last one
    run_dir = tmp_path / "run"
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    # vime-n2's first `ray start` fails the way a node that GCS cannot find does; the job's
    # steps find this `ray` first on their PATH, and it runs the real one from then on.
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "ray").write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = start ] && [ "$SLURMD_NODENAME" = vime-n2 ] && mkdir "{tmp_path}/failed"'
        " 2>/dev/null; then\n"
        '  echo "Exception: The current node timed out during startup (injected)" >&2; exit 1\n'
        "fi\n"
        f'exec "{Path(sys.executable).parent / "ray"}" "$@"\n'
    )
    (shim / "ray").chmod(0o755)
    ray_port = free_port("127.0.0.2")
    rendered = subprocess.run(
        [
            sys.executable,
            "-m",
            "vime.cli",
            "slurm",
            "configs/slurm_cpu_2node.yaml",
            "--dry-run",
            f"run_dir={run_dir}",
            f"engine.model_path={tiny_model_dir}",
            "model.preset=null",
            f"num_steps={num_steps}",
            "weight_sync.verify_checksums=true",
            "engine.fault_tolerance=true",
            # The fleet across nodes: a second engine joins on vime-n2 at step 2, its weights
            # copied from engine 0 (a rendezvous on vime-n1, the bytes between the engines on
            # vime-n2).
            "weight_sync.transport.delta=true",
            "fleet.schedule=[{step: 2, join: 1, wait: true}]",
            "fleet.max_engines=2",
            "fleet.first_weights=engine",
            "cluster.engine_num_cpus=0.5",
            "rollout.num_prompts_per_step=4",
            "rollout.num_samples_per_prompt=4",
            "cluster.job_name=vime-test-2node",
            f"cluster.slurm.log_dir={log_dir}",
            f"cluster.slurm.script_dir={tmp_path}",
            f"cluster.slurm.ray_port={ray_port}",
            f"cluster.slurm.rdzv_port={free_port('127.0.0.2')}",
            f'cluster.slurm.setup=["source .venv/bin/activate", "export PATH={shim}:$PATH"]',
        ],
        cwd=REPO_ROOT,
        env=slurm,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rendered.returncode == 0, rendered.stderr
    script = Path(rendered.stdout.split()[-1])
    assert rendered.stdout.strip() == f"sbatch {script}"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    shm_before = set(Path("/dev/shm").iterdir())

    start = time.monotonic()
    with subprocess.Popen(
        ["sbatch", "--parsable", "--wait", str(script)],
        cwd=REPO_ROOT,
        env=slurm,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as job:
        killed = _kill_engine_core_after_first_step(run_dir, job)
        try:
            stdout, stderr = job.communicate(timeout=900)
        finally:
            job.kill()
    submitted = subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)
    wall_s = time.monotonic() - start
    job_id = submitted.stdout.strip().split(";")[0]
    batch_log = next(log_dir.glob(f"*-{job_id}.out"), None)
    logs = batch_log.read_text() if batch_log else "(no batch log)"
    job_logs = log_dir / f"vime-test-2node-{job_id}"
    trainer_log = job_logs / "trainer-node0.log"
    assert submitted.returncode == 0, (
        f"{submitted.stderr}\n{logs[-3000:]}\n"
        f"{trainer_log.read_text()[-6000:] if trainer_log.exists() else ''}"
    )
    print(f"two-node Slurm job {job_id}: {wall_s:.1f} s from sbatch to exit")

    # Where things ran, from the job's own records.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_node"] == "vime-n1"
    assert summary["trainer_address"] == NODE_ADDRESSES["vime-n1"]
    engines = json.loads((run_dir / "engines.json").read_text())  # rewritten by the fleet
    assert [e["left"] for e in engines] == [False, False]
    for engine in engines:
        assert engine["slurm_node"] == "vime-n2"
        assert engine["address"] == NODE_ADDRESSES["vime-n2"]
        assert engine["url"].startswith(f"http://{NODE_ADDRESSES['vime-n2']}:")
    engine = engines[0]
    assert re.search(r"vime-n1 \(127\.0\.0\.2\): torchrun .*--nnodes=1", trainer_log.read_text())
    assert "every node joined Ray: vime-n1,vime-n2" in logs
    # vime-n2's Ray started on its second attempt, in a temp dir of its own.
    ray_n2 = (job_logs / "ray-vime-n2.log").read_text()
    assert "timed out during startup (injected)" in ray_n2
    assert "ray start failed before the node started (exit status 1); retrying" in ray_n2
    assert f"--temp-dir=/tmp/vime-ray-{job_id}-vime-n2" in ray_n2 and "attempt 2/3" in ray_n2

    # Every sync reached the engine on the other node, checked by checksums.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(num_steps))
    assert [row["sync/weight_version"] for row in rows] == list(range(1, num_steps + 1))
    assert all(row["sync/verified"] == 1.0 for row in rows)
    assert all(row["rollout/num_samples"] == 16 for row in rows)
    # The engine died on vime-n2 and was restarted there, synced and served again.
    assert killed is not None, "the job ended before a step was logged"
    trainer = trainer_log.read_text()
    engine_url = re.escape(engine["url"])
    assert re.search(rf"restarting engine 0 \(engine 0 at {engine_url} is dead", trainer), trainer
    assert "fault tolerance: engine 0 serves again" in trainer
    assert rows[-1]["fault/engine_restarts"] == 1.0
    # The joiner: engine 0's weights copied at a safe point, then that step's sync was a delta for
    # both engines (checked by checksums, like every sync), then it served.
    assert (rows[-1]["fleet/joins"], rows[-1]["fleet/peer_copied"]) == (1.0, 1.0)
    joined = next(row for row in rows if row["fleet/size"] == 2.0)
    assert joined["sync/delta"] == 1.0 and joined["sync/verified"] == 1.0
    assert re.search(r"engine 1 copied from engine 0 as version \d+: .* checksums equal", trainer)
    assert "engine 1 serves" in trainer
    for name in ("metrics.png", "summary.txt", "config.resolved.json"):
        assert (run_dir / name).exists(), name

    # Nothing of the job outlives it: no process, no shared-memory segment.
    deadline = time.monotonic() + 30
    left = processes_of_job(job_id)
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = processes_of_job(job_id)
    assert not left, f"processes of job {job_id} still running: {left}"
    assert set(Path("/dev/shm").iterdir()) - shm_before == set()
    for node in NODE_ADDRESSES:
        assert not Path(f"/tmp/vime-ray-{job_id}-{node}").exists(), f"{node}'s Ray temp dir is left"
    state = subprocess.run(
        ["scontrol", "show", "job", job_id], env=slurm, capture_output=True, text=True, timeout=30
    ).stdout
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state
