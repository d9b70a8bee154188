"""What `vime bench-sync` measures and how it prints: one method's iterations, one dtype's
results, the table and the summary lines.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from statistics import median

logger = logging.getLogger("vime.bench")
NAN = math.nan

BENCH_TRANSPORTS = ("gloo", "shm")  # the CPU ones
# --shadow: the weight_sync.shadow settings each transport runs with, in order.
SHADOW_MODES = {"off": (False,), "on": (True,), "both": (False, True)}
# --pack: weight_sync.pack_before_pause for shm without shadow ("in": rows shm+pack-in-pause).
PACK_MODES = {"before": (True,), "in": (False,), "both": (True, False)}
# The columns of a sync, in order; with "other" (barriers, bookkeeping) they add up to the total
# from the first step to resume. "prepare": a colocated sync's gather, convert and pack before the
# engines pause (weight_sync.pack_before_pause; those columns are then part of it). "wait" is the
# trainer waiting for the bytes to move and the engines to load them, beyond the packing it
# overlaps with.
SYNC_PHASES = (
    "prepare",
    "pause",
    "flush",
    "start",
    "gather",
    "convert",
    "pack",
    "wait",
    "stage",
    "finish",
    "resume",
)
FLOOR_REPEATS = 3  # memcpy_floor's copies; the floor is the fastest
# Measured inside the engine (vime_weight_update_stats); they overlap the trainer's columns.
ENGINE_PHASES = ("engine_receive", "engine_load")


@dataclass
class Measurement:
    """One method's timed iterations for one dtype: phase -> seconds, "total" = first step to
    resume."""

    method: str
    dtype: str
    num_bytes: int
    iterations: list[dict[str, float]] = field(default_factory=list)
    engine_stats: list[dict[str, float]] = field(default_factory=list)
    num_requests: int = 0  # update_weights requests per sync
    engine_rss_gib: list[float] = field(default_factory=list)  # after each sync, warm-up included
    warmup_totals: list[float] = field(default_factory=list)  # seconds of the untimed syncs

    def mean(self) -> dict[str, float]:
        keys = {key for iteration in self.iterations for key in iteration}
        count = max(len(self.iterations), 1)
        return {k: sum(it.get(k, 0.0) for it in self.iterations) / count for k in sorted(keys)}

    def typical(self) -> dict[str, float]:
        """The phases of the iteration with the median total: one real sync, robust to a hiccup
        of the machine (the table shows it; the JSON keeps every iteration and the means)."""
        if not self.iterations:
            return {}
        ranked = sorted(self.iterations, key=lambda it: it.get("total", 0.0))
        return dict(ranked[(len(ranked) - 1) // 2])


@dataclass
class DtypeResult:
    dtype: str
    num_tensors: int
    num_bytes: int
    floor_s: float  # one memcpy with every core of the machine: the ratios' denominator
    floor_pinned_s: float  # the same on the trainer's pinned core(s)
    engine_startup_s: dict[str, float]
    measurements: list[Measurement]
    num_cores: int = 0  # the machine's cores this run could use (the floor's)
    preset: str = ""  # the model (vime.testing.tiny_model preset)


# ---- the report --------------------------------------------------------------------------------


def result_labels(results: list[DtypeResult]) -> list[str]:
    """How the table and the summary name each result: its dtype, and its model when the run
    measured several (`--sizes`)."""
    several_models = len({r.preset for r in results}) > 1
    return [f"{r.preset} {r.dtype}" if several_models else r.dtype for r in results]


def format_table(results: list[DtypeResult]) -> str:
    """The screen table: seconds per phase of the median sync, first step -> resume, GB/s, x floor.

    n: the timed syncs of the row (warm-up not counted); each row shows the one whose total is
    the median (the lower one of an even count): a real sync, not a mix. req: update_weights
    requests per sync, as counted by the engine. The floors are the fastest of FLOOR_REPEATS.
    """
    columns = [*SYNC_PHASES, "other", "save", "reload", *ENGINE_PHASES]
    names = {"engine_receive": "eng.recv", "engine_load": "eng.load"}
    header = ["dtype", "method", "n", "req", *(names.get(c, c) for c in columns)]
    header += ["total", "GB/s", "x floor"]
    rows = []
    for result, label in zip(results, result_labels(results), strict=True):
        floors = [
            (f"memcpy {result.num_cores} cores", result.floor_s),
            ("memcpy 1 core", result.floor_pinned_s),
        ]
        for name, seconds in floors:
            rows.append(
                [label, name, f"min/{FLOOR_REPEATS}", "", *[""] * len(columns)]
                + [f"{seconds:.3f}", f"{result.num_bytes / seconds / 1e9:.1f}"]
                + [f"{seconds / result.floor_s:.1f}"]
            )
        for m in result.measurements:
            typical = m.typical()
            total = typical.get("total", 0.0)
            cells = [f"{typical[c]:.3f}" if c in typical else "" for c in columns]
            gbps = f"{m.num_bytes / total / 1e9:.2f}" if m.num_bytes and total else ""
            ratio = f"{total / result.floor_s:.1f}" if m.num_bytes and result.floor_s else ""
            rows.append(
                [label, m.method, str(len(m.iterations)), str(m.num_requests or ""), *cells]
                + [f"{total:.3f}", gbps, ratio]
            )
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(str(cell).rjust(w) for cell, w in zip(cells, widths, strict=True))

    head = line(header)
    return "\n".join([head, "-" * len(head), *map(line, rows)])


def control_breakdown(control: Measurement) -> str:
    """Each round trip's median in ms; start and finish with the worker's own share."""
    parts = []
    for phase in ("pause", "flush", "start", "finish", "resume"):
        values = [it[phase] for it in control.iterations if phase in it]
        if not values:
            continue
        text = f"{phase} {median(values) * 1e3:.1f}"
        inside = [it[f"engine_{phase}"] for it in control.iterations if f"engine_{phase}" in it]
        if inside:
            text += f" ({median(inside) * 1e3:.1f} in the worker)"
        parts.append(text)
    return "medians in ms: " + ", ".join(parts)


def quartiles(values: list[float]) -> tuple[float, float]:
    """(first, third) quartile, linear interpolation between the sorted values."""
    ordered = sorted(values)

    def at(q: float) -> float:
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return at(0.25), at(0.75)


def shadow_line(method: str, iterations: list[dict[str, float]], typical: dict) -> str:
    """A weight_sync.shadow row: the sync, the pause within it, what a streaming client saw."""

    def middle(key: str) -> float:
        values = [it[key] for it in iterations if not math.isnan(it.get(key, NAN))]
        return median(values) if values else NAN

    return (
        f"{method}: sync {typical.get('total', NAN):.3f} s, of which the engines were paused "
        f"{middle('paused'):.3f} s (the swap) while their load beside the served weights took "
        f"{typical.get('engine_load', NAN):.3f} s; a request streaming through it stood still "
        f"{middle('stall'):.3f} s at the switch, its longest gap during the sync "
        f"{middle('longest_gap'):.3f} s, against {middle('step_gap'):.3f} s between two of its "
        f"chunks before the sync (medians of {len(iterations)})"
    )


def summarize(results: list[DtypeResult]) -> list[str]:
    """The targets' ratios (shm and gloo to the memcpy floor, disk to shm), each one line."""
    lines = []
    for result, label in zip(results, result_labels(results), strict=True):
        means = {m.method: m.typical() for m in result.measurements}
        measured = {m.method: m.iterations for m in result.measurements}
        by_method = {method: mean.get("total", 0.0) for method, mean in means.items()}
        for method in ("shm", "shm+pack-in-pause", "gloo"):
            shadow = f"{method}+shadow"
            if shadow in by_method and measured[shadow]:
                lines.append(f"{label} {shadow_line(shadow, measured[shadow], means[shadow])}")
            if method not in by_method:
                continue
            total = by_method[method]
            line = (
                f"{label} {method}: {total:.3f} s = {total / result.floor_s:.1f}x the memcpy floor"
            )
            load = means[method].get("engine_load", 0.0)
            if load:
                rest = total - load
                line += (
                    f" ({rest:.3f} s = {rest / result.floor_s:.1f}x without the engine's own "
                    f"load_weights, {load:.3f} s)"
                )
            timed = [it for it in measured[method] if "paused" in it]  # rank 0's
            if load and timed:  # the engines' pause less their own work: vime's share of it
                engine_keys = ("engine_start", "engine_load", "engine_finish")
                share = median(
                    it["paused"] - sum(it.get(key, 0.0) for key in engine_keys) for it in timed
                )
                line += (
                    f"; engines paused {median(it['paused'] for it in timed):.3f} s, of which "
                    f"vime's share (beyond the worker's own start, load and finish) {share:.3f} "
                    f"s = {share / result.floor_s:.1f}x the floor (medians of {len(timed)})"
                )
            stalls = [
                it["stall"] for it in measured[method] if not math.isnan(it.get("stall", NAN))
            ]
            if stalls:
                paused = median(it["paused"] for it in measured[method])
                line += (
                    f"; a request streaming through it stood still {median(stalls):.3f} s "
                    f"(median of {len(stalls)}; engines paused {paused:.3f} s)"
                )
            for baseline in ("disk", "naive"):
                if baseline in by_method:
                    line += f"; {baseline} takes {by_method[baseline] / total:.1f}x as long"
            lines.append(line)
        control = next((m for m in result.measurements if m.method == "control"), None)
        if control is not None and control.iterations:
            low, high = quartiles([it["total"] for it in control.iterations])
            lines.append(
                f"{label} control plane (no bytes): {by_method['control'] * 1e3:.1f} ms, "
                f"median of {len(control.iterations)} sessions (quartiles {low * 1e3:.1f}-"
                f"{high * 1e3:.1f} ms); {control_breakdown(control)}"
            )
    return lines
