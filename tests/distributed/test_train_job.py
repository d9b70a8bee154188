"""The RL job end to end, CI-sized: torchrun trainer ranks, a real vLLM CPU engine, sync every step.

Runs `torchrun -m vime.train` on the repo's own configs with a few steps and checks what the run
recorded: the main job's supervised stage and held-out evaluations, versions advance every step,
engine weights equal the trainer's after each sync (verify_checksums), the async loop overlaps
generation and training, nothing is lost.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from vime.train import torchrun_command

pytestmark = pytest.mark.distributed

REPO_ROOT = Path(__file__).resolve().parents[2]


def job_command(config: str, run_dir: Path, model_dir: Path, *overrides: str, nproc: int = 1):
    """torchrun -m vime.train on a repo config, with the test's run dir and model."""
    return torchrun_command(
        REPO_ROOT / "configs" / config,
        f"run_dir={run_dir}",
        f"engine.model_path={model_dir}",
        "model.preset=null",
        *overrides,
        nproc=nproc,
    )


def run_job(
    config: str,
    tmp_path: Path,
    model_dir: Path,
    *overrides: str,
    nproc: int = 1,
    during: Callable[[Path, subprocess.Popen], None] | None = None,
):
    """Run the job to its end (`during(run_dir, process)` runs meanwhile); its metrics rows."""
    run_dir = tmp_path / "run"
    cmd = job_command(config, run_dir, model_dir, *overrides, nproc=nproc)
    with open(tmp_path / "job.out", "w+") as out:
        process = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        try:
            if during is not None:
                during(run_dir, process)
            returncode = process.wait(timeout=600)
        finally:
            if process.poll() is None:
                process.kill()
        out.seek(0)
        assert returncode == 0, out.read()[-8000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows


def _preempt_engine_after_step(rank: int, step: int) -> Callable[[Path, subprocess.Popen], None]:
    """SIGTERM engine `rank`'s keeper (a preemption notice) once step `step` is logged."""

    def during(run_dir: Path, process: subprocess.Popen) -> None:
        metrics, log = run_dir / "metrics.jsonl", run_dir / "engines" / f"vllm-engine-{rank}.log"
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline and process.poll() is None:
            rows = metrics.read_text().splitlines() if metrics.exists() else []
            if len(rows) > step:
                keepers = re.findall(r"vime keeper (\d+): server pid", log.read_text())
                assert keepers, f"engine {rank} never started"
                os.kill(int(keepers[-1]), signal.SIGTERM)
                return
            time.sleep(0.5)

    return during


def test_main_job_sft_then_async_rl_syncs_every_step_and_overlaps(tmp_path, tiny_model_dir):
    """The README's main job (SFT warm start, then async GRPO), shortened, with delta syncs and
    an elastic fleet: fleet.scale_up launches two engines, which join before step 1's sync (the
    step waits for them); engine 0 is told to leave at step 2; engine 2 is preempted (SIGTERM
    to its keeper) once step 1 is logged. Both drain and leave; the job ends on engine 1 alone."""
    num_steps, sft_steps = 5, 10
    run_dir, rows = run_job(
        "tiny_cpu_sft_rl.yaml",
        tmp_path,
        tiny_model_dir,
        f"num_steps={num_steps}",
        f"sft.num_steps={sft_steps}",
        "weight_sync.verify_checksums=true",
        "weight_sync.transport={kind: shm, delta: true}",
        "rollout.num_prompts_per_step=4",
        "rollout.num_samples_per_prompt=4",
        # Rollouts "behind" at any wait: two steps in, the policy launches up to max_engines.
        "fleet.scale_up={wait_s: 0.0, steps: 2, add: 2, wait: true}",
        "fleet.max_engines=3",
        "fleet.first_weights=engine",  # not auto: which way is cheaper on this machine is timing
        "fleet.schedule=[{step: 2, leave: [0]}]",
        "engine.preemption_drain_s=120",
        "cluster.engine_num_cpus=0.5",  # three engines on the local Ray node's 2 CPUs
        during=_preempt_engine_after_step(2, step=1),
    )
    assert [row["step"] for row in rows] == list(range(num_steps))
    metrics = rows
    # The fleet: engines 1 and 2 got engine 0's weights (fleet.first_weights=engine: checksums
    # equal),
    # took step 1's sync (a delta, like every other engine's) and then served.
    # Engine 0 drained from step 2, engine 2 from its notice (no new request for either; what
    # they held finished there), each leaving at the first safe point after its last request.
    sizes = [m["fleet/size"] for m in metrics]
    serving = [m["fleet/serving"] for m in metrics]
    assert sizes[:2] == [1, 3] and sizes[-1] == 1, sizes
    assert all(a >= b for a, b in zip(sizes[1:], sizes[2:], strict=False)), sizes
    assert serving[:2] == [1, 3] and serving[-1] == 1, serving
    last = metrics[-1]
    assert (last["fleet/joins"], last["fleet/leaves"], last["fleet/preempted"]) == (2, 2, 1)
    assert last["fleet/scale_ups"] == 1  # once: max_engines, then a fleet too new to judge
    assert last["fleet/handed_over"] == 0
    # Groups were rebuilt at each change, yet every RL sync is a delta: the joiners got a peer copy
    # with the tensors the others hold, leavers take none with them.
    assert last["fleet/peer_copied"] == 2
    assert [m["sync/delta"] for m in metrics] == [1.0] * num_steps, metrics
    assert [m["sync/delta_repaired"] for m in metrics] == [0.0] * num_steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["fleet_join_to_serve_s"]) == 2 and len(summary["fleet_drain_s"]) == 2
    assert len(summary["fleet_peer_copy_s"]) == 2
    # Engine 2 left because the job drained it (vime's stop, SIGINT), within its 120 s grace.
    engine2 = (run_dir / "engines" / "vllm-engine-2.log").read_text()
    assert "preemption notice" in engine2 and "signal SIGINT; ending process group" in engine2
    assert "preempted (SIGTERM)" not in engine2
    # The supervised stage: its loss fell, and its weights went to the engine as version 1.
    sft = [json.loads(line) for line in (run_dir / "sft.jsonl").read_text().splitlines()]
    assert [row["step"] for row in sft] == list(range(sft_steps))
    assert sft[-1]["sft/loss"] < 0.5 * sft[0]["sft/loss"]
    # The engine's version advances once per step and its weights equal the trainer's each time.
    assert [m["sync/weight_version"] for m in metrics] == list(range(2, num_steps + 2))
    assert all(m["sync/verified"] == 1.0 for m in metrics)
    # The SFT weights went in full (the engine's baseline), the RL steps as deltas: exact all
    # the same (checksums), and the rows of tokens no sample used stay unchanged (AdamW moves no
    # element whose gradient and moments are zero).
    deltas = [m for m in metrics if m["sync/delta"] == 1.0]
    assert all(0.0 < m["sync/changed_fraction"] < 1.0 for m in deltas)
    assert all(m["sync/bytes"] < m["sync/full_bytes"] for m in deltas)
    # The online proof that sync is exact: tokens sampled by the weights the trainer holds get the
    # same log-prob in the trainer as in the engine (fp32, same kernels up to reduction order).
    same = [
        m["train/logprob_diff_same_version"]
        for m in metrics
        if "train/logprob_diff_same_version" in m
    ]
    assert same and max(same) < 1e-4, same
    weight_l1 = [m["train/weight_l1"] for m in metrics]
    assert len(set(weight_l1)) == num_steps, "weights did not change every step"
    # Every request came back whole: no sample lost, none retried after an abort.
    assert all(m["rollout/num_samples"] == 16 for m in metrics)
    assert all(m["rollout/aborted_retries"] == 0 for m in metrics)
    # One-off pipelining: batch k+1 was being generated before training on batch k ended.
    for current, following in zip(metrics, metrics[1:], strict=False):
        assert following["time/gen_start"] < current["time/train_end"]
    # Rewards and staleness are recorded. (How stale batch k+1 is depends on whether its requests
    # reached the engine before sync k: timing, not asserted.)
    assert all(0.0 <= m["rollout/reward_mean"] <= 1.0 for m in metrics)
    # One step of staleness at most: a batch's tokens are from this or the previous version.
    assert all(m["staleness/lag_max"] in (0, 1) for m in metrics), metrics
    assert all(0 <= m["staleness/lag_mean"] <= m["staleness/lag_max"] for m in metrics)
    assert all(0 <= m["staleness/version_span_mean"] <= 1 for m in metrics)
    for name in ("metrics.png", "summary.txt", "config.resolved.json", "summary.json"):
        assert (run_dir / name).exists(), name
    assert list(run_dir.glob("events.out.tfevents.*")) or list(run_dir.rglob("events.out.*"))
    # Held-out evaluation (the main config's eval.prompts_path): greedy, every test prompt once,
    # on the initial model (version 0), the SFT model (version 1) and after the last sync.
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    stages = [(e["stage"], e["step"], e["eval/weight_version"]) for e in evals]
    assert stages == [("before", 0, 0), ("after_sft", 0, 1), ("after", num_steps, num_steps + 1)]
    assert all(e["eval/num_prompts"] == 100 and 0 <= e["eval/pass_at_1"] <= 1 for e in evals)
    # Ten supervised steps already write digits: the eval's mean reward rises from ~0.06.
    assert evals[1]["eval/reward_mean"] > evals[0]["eval/reward_mean"] + 0.2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"]["after"]["eval/pass_at_1"] == evals[2]["eval/pass_at_1"]
    assert summary["sft"]["sft/num_steps"] == sft_steps
    text = (run_dir / "summary.txt").read_text()
    assert "held-out greedy pass@1" in text and "after SFT" in text
    # The final checkpoint (checkpoint.at_end) is complete.
    assert (run_dir / "checkpoints" / f"step_{num_steps}" / "metadata.json").is_file()


@pytest.mark.parametrize(
    ("kind", "num_engines", "sampling"),
    [
        ("nccl", 1, ()),
        # Sampled at temperature 0.7 within top-p 0.9: the engines return the log-probs of that
        # distribution and the trainer computes the same; token-level IS weights, capped.
        (
            "ipc",
            2,
            (
                "rollout.temperature=0.7",
                "rollout.top_p=0.9",
                "grpo.off_policy={level: token, cap: 2.0}",
            ),
        ),
    ],
    ids=["nccl-1", "ipc-2-top-p"],
)
def test_sync_loop_with_virtual_pipeline_stages_with_kl_and_rollouts(
    tmp_path, model_builder, kind, num_engines, sampling
):
    """Two trainer ranks, two pipeline stages of two virtual stages each (a four-layer model:
    rank 0 holds layers 0 and 2, rank 1 layers 1 and 3): megatron's interleaved 1F1B schedule
    trains (the KL reference through it too), each stage syncs its chunks' layers with delta
    syncs, bit-exact by the engines' checksums, and the checkpoint at the end holds every chunk.
    nccl: each stage over its own broadcast group into one engine; ipc: each stage's sender posts
    its buckets' handles to two colocated engines. Both with their CPU plug-ins (`device: cpu`):
    the code a GPU job runs above NCCL and CUDA IPC."""
    run_dir, rows = run_job(
        "tiny_cpu_async_gloo.yaml",
        tmp_path,
        model_builder("qwen2-tiny-4layer"),
        f"weight_sync.transport={{kind: {kind}, device: cpu, delta: true}}",
        f"engine.num_engines={num_engines}",
        "trainer.pipeline_parallel_size=2",
        "trainer.virtual_pipeline_parallel_size=2",
        "weight_sync.verify_checksums=true",
        "num_steps=2",
        "rollout.max_staleness=0",
        "rollout.num_prompts_per_step=2",
        "rollout.num_samples_per_prompt=4",
        "grpo.kl_coef=0.05",
        "save_rollouts=true",
        *sampling,
        nproc=2,
    )
    metrics = rows
    assert [m["sync/weight_version"] for m in metrics] == [1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model_chunks_per_rank"] == 2 and summary["failed"] is False
    # Synchronous: each batch is generated after the previous step's training and sync.
    assert metrics[1]["time/gen_start"] >= metrics[0]["time/train_end"]
    # With the sync loop every token comes from the trainer's current weights.
    assert all(m["staleness/lag_max"] == 0 for m in metrics)
    # The reference is the initial policy: no KL before the first update, some after it.
    assert metrics[0]["train/kl_ref"] == 0.0 and metrics[1]["train/kl_ref"] > 0.0
    # The engine serves what the two stages hold: the trainer's log-probs of every sample (all
    # generated by the current weights) equal the engine's up to float noise.
    assert all(m["sync/verified"] == 1.0 for m in metrics)
    # The first sync goes in full, the second as a delta at PP=2 (each stage commits its own).
    assert [m["sync/delta"] for m in metrics] == [0.0, 1.0], metrics
    # With temperature and top-p too: the gap is float noise, not a sampling mismatch (at 0.7 /
    # 0.9 on raw log-probs it would be ~0.1 and more).
    assert all(m["train/logprob_diff_same_version"] < 1e-3 for m in metrics), metrics
    if sampling:
        assert all(0.9 < m["train/is_weight_p50"] < 1.1 for m in metrics), metrics
        assert all(m["train/mismatch_kl"] < 1e-4 for m in metrics), metrics
    assert all(m["train/same_version_token_fraction"] == 1.0 for m in metrics)
    assert (run_dir / "checkpoints" / "step_2" / "metadata.json").is_file()
    samples = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 8 + [1] * 8
    for sample in samples:
        assert len(sample["response_token_ids"]) == len(sample["rollout_logprobs"]) > 0
        assert set(sample["weight_versions"]) == {sample["step"]} and sample["lag"] == 0
        assert isinstance(sample["reward"], float)


def test_failure_after_launch_ends_the_engine_servers(tmp_path, tiny_model_dir):
    """An error once the engines are up (here: the engine was started with the other sync
    shape's receiver, which only the engine can tell, at the pre-send check) must not leave a
    vLLM server behind:
    the job ends the process group of every server it started, and its summary says it
    failed."""
    import re
    import time

    run_dir = tmp_path / "run"
    completed = subprocess.run(
        job_command(
            "tiny_cpu_async.yaml",
            run_dir,
            tiny_model_dir,
            # The config's transport is shm; a later --weight-transfer-config wins in vLLM.
            """engine.extra_args=['--weight-transfer-config', '{"backend": "vime_broadcast"}']""",
        ),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode != 0
    assert "trainer weights do not fit the engines" in completed.stderr, completed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failed"] is True and "do not fit the engines" in summary["error"]
    log = (run_dir / "engines" / "vllm-engine-0.log").read_text()
    pids = {int(pid) for pid in re.findall(r"\((?:APIServer|EngineCore) pid=(\d+)\)", log)}
    assert pids, "the engine log names no server process"
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in pids if _is_alive(pid)}
        time.sleep(0.5)
    assert not alive, f"vLLM processes left running: {alive}"


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_external_tp2_engine_on_another_node_syncs_over_gloo(tmp_path, tiny_model_dir, monkeypatch):
    """engine.external_urls on another node: the trainer's node is 127.0.0.2, the engine (started
    here, as someone else's server would be) 127.0.0.3, with tensor parallelism 2; the job reads
    its two workers from the server and the weight-sync group (1 + 2 ranks) joins across. The job
    generates up to two batches ahead (rollout.max_staleness=2): requests run through the syncs
    of the steps they wait behind, and no sample is older than its bound.

    The launch first loses its port: the port it chose is bound by another socket before vLLM
    binds it (what a process binding port 0 can do), and it starts again on another."""
    from vime.config import EngineConfig
    from vime.engines import server as server_module
    from vime.engines.server import launch_server
    from vime.utils.net import free_port

    taken = socket.socket()
    taken.bind(("127.0.0.3", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    chosen = iter([taken_port])
    monkeypatch.setattr(
        server_module, "free_port", lambda host: next(chosen, None) or free_port(host)
    )

    engine = EngineConfig(
        model_path=str(tiny_model_dir),
        weight_transfer_backend="gloo",
        tensor_parallel_size=2,
        max_model_len=256,
        max_num_seqs=128,
    )
    with taken:
        server = launch_server(
            engine, host="127.0.0.3", port=None, log_path=tmp_path / "engine.log"
        )
    assert server.url != f"http://127.0.0.3:{taken_port}"
    assert b"Address already in use" in (tmp_path / "engine.log").read_bytes()
    try:
        run_dir = tmp_path / "run"
        cmd = job_command(
            "tiny_cpu_async_gloo.yaml",
            run_dir,
            tiny_model_dir,
            "num_steps=4",
            "weight_sync.verify_checksums=true",
            "rollout.max_staleness=2",
            "rollout.num_prompts_per_step=2",
            "rollout.num_samples_per_prompt=4",
            f"engine.external_urls=[{server.url}]",
        )
        completed = subprocess.run(
            cmd,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "VIME_HOST_IP": "127.0.0.2"},
        )
        assert completed.returncode == 0, completed.stderr[-6000:]
    finally:
        server.stop()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["sync/weight_version"] for m in rows] == [1, 2, 3, 4]
    assert all(m["sync/verified"] == 1.0 for m in rows)
    # Every sample of every step trained on (none lost, none beyond the bound, so none dropped).
    assert all(m["rollout/num_samples"] == 8 for m in rows), rows
    assert all(m["staleness/lag_max"] <= 2 for m in rows), rows
    assert all(m.get("rollout/dropped_stale", 0) == 0 for m in rows), rows
    assert json.loads((run_dir / "summary.json").read_text())["trainer_address"] == "127.0.0.2"
    assert (
        "via 127.0.0.2:" in completed.stderr
    )  # the gloo rendezvous listened on the trainer's node
