"""The weight-sync matrix as whole RL jobs into real vLLM engines, for a GPU machine with vLLM's
CUDA build (`--device cuda`, the default) or, with the same cases, on CPU (`--device cpu`: the
CPU plug-ins, every process on the shared host).

    python tools/gpu_matrix.py [--device cuda|cpu] [--cases ipc-1gpu,nccl-pp2] [--list]

Each case runs `torchrun -m vime.train` on `configs/tiny_cpu_async_gloo.yaml` (a tiny random
Qwen2 built on the spot, no download) for three synchronous steps with delta syncs and the
engines' checksums on, then checks its metrics: every sync verified bit for bit on every engine,
the first full and the later ones deltas, the job not failed. On CUDA a case runs when the
machine has the GPUs it names (trainer ranks on GPUs 0..nproc-1 via LOCAL_RANK, engines on the
GPUs of `engine.device_ids`); the others are listed as skipped. Exit status 1 if any ran and
failed. Never run on a GPU so far (no machine with vLLM's CUDA build was available); the CPU
cases run the same configs with `device: cpu` (the suite's distributed tier runs these shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as a script from a checkout: vime is the repo's own

from vime.train import torchrun_command  # noqa: E402

CONFIG = REPO_ROOT / "configs" / "tiny_cpu_async_gloo.yaml"
STEPS = 3


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # ipc | nccl
    nproc: int  # trainer ranks (GPUs 0..nproc-1)
    device_ids: tuple[str, ...]  # one entry per engine: its GPUs (CUDA_VISIBLE_DEVICES)
    overrides: tuple[str, ...] = ()
    preset: str = "qwen2-tiny"

    @property
    def gpus(self) -> int:
        used = set(range(self.nproc))
        for ids in self.device_ids:
            used |= {int(i) for i in ids.split(",")}
        return max(used) + 1


# The shapes of the GPU-shapes issue: ipc on one GPU (trainer and engine share it), ipc across
# two GPUs (a colocated PP=2 job, one engine per GPU reading the holder on its own GPU), nccl
# with one group per pipeline stage (PP=2, and PP=2 x VPP=2), nccl into a TP=2 engine and into
# two engines (rank offsets).
CASES = (
    Case("ipc-1gpu", "ipc", 1, ("0",), ("engine.gpu_memory_utilization=0.3",)),
    Case(
        "ipc-pp2-2gpu",
        "ipc",
        2,
        ("0", "1"),
        ("trainer.pipeline_parallel_size=2", "engine.gpu_memory_utilization=0.3"),
    ),
    Case("nccl-pp2-3gpu", "nccl", 2, ("2",), ("trainer.pipeline_parallel_size=2",)),
    Case(
        "nccl-pp2-vpp2-3gpu",
        "nccl",
        2,
        ("2",),
        ("trainer.pipeline_parallel_size=2", "trainer.virtual_pipeline_parallel_size=2"),
        preset="qwen2-tiny-4layer",
    ),
    Case(
        "nccl-tp2-engine-4gpu",
        "nccl",
        2,
        ("2,3",),
        ("trainer.tensor_parallel_size=2", "engine.tensor_parallel_size=2"),
    ),
    Case("nccl-two-engines-4gpu", "nccl", 2, ("2", "3"), ("trainer.tensor_parallel_size=2",)),
)


def overrides(case: Case, device: str, run_dir: Path) -> list[str]:
    """The job's dotted overrides for `case` on `device`; on CPU the engines stay on the shared
    host (no device ids: the CPU plug-ins need none)."""
    items = [
        f"run_dir={run_dir}",
        f"model.preset={case.preset}",
        f"engine.model_path={run_dir.parent / 'models' / case.preset}",
        f"engine.num_engines={len(case.device_ids)}",
        f"weight_sync.transport={{kind: {case.kind}, device: {device}, delta: true}}",
        "weight_sync.verify_checksums=true",
        f"num_steps={STEPS}",
        "rollout.max_staleness=0",
        "rollout.num_prompts_per_step=2",
        "rollout.num_samples_per_prompt=4",
        *case.overrides,
    ]
    if device == "cuda":
        items.append(f"engine.device_ids={json.dumps(list(case.device_ids))}")
    else:
        items = [item for item in items if "gpu_memory_utilization" not in item]
    return items


def check(run_dir: Path) -> str | None:
    """What is wrong with a finished case's run, or None."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return "no metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    if [row.get("sync/weight_version") for row in rows] != list(range(1, STEPS + 1)):
        return f"weight versions {[row.get('sync/weight_version') for row in rows]}"
    if not all(row.get("sync/verified") == 1.0 for row in rows):
        return "a sync was not verified by the engines' checksums"
    if [row.get("sync/delta") for row in rows] != [0.0] + [1.0] * (STEPS - 1):
        return f"sync/delta {[row.get('sync/delta') for row in rows]} (want one full, then deltas)"
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("failed"):
        return f"the job failed: {summary.get('error')}"
    return None


def run_case(case: Case, device: str, work: Path, timeout_s: float) -> dict:
    run_dir = work / case.name / "run"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    command = torchrun_command(CONFIG, *overrides(case, device, run_dir), nproc=case.nproc)
    log = run_dir.parent / "job.log"
    started = time.monotonic()
    with open(log, "w") as out:
        # Its own session: a timeout ends torchrun, its ranks and the engines they started.
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 15)
            process.wait(timeout=60)
            returncode = None
    seconds = round(time.monotonic() - started, 1)
    if returncode is None:
        problem = f"timed out after {timeout_s:g} s"
    elif returncode != 0:
        problem = f"exit status {returncode}"
    else:
        problem = check(run_dir)
    result = {"case": case.name, "seconds": seconds, "ok": problem is None, "log": str(log)}
    if problem is not None:
        result["problem"] = problem
        result["log_tail"] = log.read_text()[-3000:]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cases", help="comma-separated names (default: all); see --list")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per case")
    parser.add_argument("--work-dir", help="where runs go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    if args.list:
        for case in CASES:
            items = " ".join(overrides(case, "cuda", Path("RUN")))
            print(f"{case.name:24s} {case.gpus} GPUs  {items}")
        return 0
    names = args.cases.split(",") if args.cases else [case.name for case in CASES]
    unknown = set(names) - {case.name for case in CASES}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; --list shows them")
    available = None
    if args.device == "cuda":
        import torch

        available = torch.cuda.device_count()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vime-gpu-matrix-"))
    results = []
    for case in (case for case in CASES if case.name in names):
        if available is not None and case.gpus > available:
            results.append(
                {"case": case.name, "skipped": f"needs {case.gpus} GPUs, {available} here"}
            )
        else:
            results.append(run_case(case, args.device, work, args.timeout))
        print(json.dumps(results[-1]), flush=True)
    failed = [result["case"] for result in results if result.get("ok") is False]
    print(
        f"gpu_matrix ({args.device}): {len(results) - len(failed)} of {len(results)} cases ok "
        f"or skipped" + (f"; FAILED: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
