"""`vime bench-sync`'s report: `--out`/bench_sync.json (every iteration of every method) and
the printed table, summary and size fit."""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

import torch

from vime.bench.sizes import fit_sizes, format_sizes, plot_sizes
from vime.bench.sync_results import DtypeResult, format_table, summarize
from vime.bench.sync_setup import engine_cpu_binding


def report(args: argparse.Namespace, argv: list[str], results: list[DtypeResult]) -> None:
    """Write `--out`/bench_sync.json and print the table, the summary and any size fit."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
    }
    document = {
        "command": "vime bench-sync " + " ".join(argv),
        "machine": machine,
        "preset": args.preset,
        "bucket_mib": args.bucket_mib,
        "tp": args.tp,
        "engine_tp": args.engine_tp,
        "engine_cpu_binding": engine_cpu_binding(args.engine_tp),
        "results": [
            {
                **asdict(r),
                "means": {m.method: m.mean() for m in r.measurements},
                "medians": {m.method: m.typical() for m in r.measurements},
            }
            for r in results
        ],
        "summary": summarize(results),
    }
    fits = fit_sizes(results) if args.sizes else []
    if fits:
        document["size_fits"] = [fit.as_dict() for fit in fits]
    path = out / "bench_sync.json"
    path.write_text(json.dumps(document, indent=2))
    model_gb = ", ".join(f"{r.preset} {r.dtype} {r.num_bytes / 1e9:.2f} GB" for r in results)
    print(
        f"\nvime bench-sync: {model_gb}; trainer TP {args.tp}, engine TP "
        f"{args.engine_tp}, seconds, the median of "
        f"{args.iterations} syncs after {args.warmup} warm-up ones"
    )
    print(format_table(results))
    print("\n".join(["", *document["summary"], f"figures: {path}"]))
    if fits:
        print("\n" + format_sizes(results, fits))
        plot = plot_sizes(fits, out / "bench_sync_sizes.png", "vime bench-sync: seconds vs bytes")
        print(f"plot: {plot} ({len(args.sizes)} sizes)")
