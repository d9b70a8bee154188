"""`vime bench-sync --sizes A B C`: how a sync's cost grows with the model's bytes.

The same benchmark runs once per model preset (each a DtypeResult per dtype); here each method's
median sync time is fitted against the model's bytes by least squares, seconds = intercept +
bytes / slope, giving the method's marginal bandwidth (slope, GB/s) and its fixed cost per sync
(intercept, s). The memcpy floor is fitted the same way. Printed as a table, written to the JSON
and drawn as seconds vs GB (PNG).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime.bench.sync_results import DtypeResult

SIZE_METHODS = ("floor", "shm", "gloo", "disk")


@dataclass
class Fit:
    method: str
    dtype: str
    points: list[tuple[float, float]]  # (GB, seconds), one per size
    seconds_per_gb: float  # the fitted line's gradient (may be <= 0 on noisy points)
    intercept_s: float

    @property
    def slope_gbps(self) -> float | None:
        """GB per second of marginal cost; None when the time does not grow with the bytes."""
        return 1.0 / self.seconds_per_gb if self.seconds_per_gb > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "dtype": self.dtype,
            "points_gb_s": self.points,
            "slope_gb_per_s": self.slope_gbps,
            "seconds_per_gb": self.seconds_per_gb,
            "intercept_s": self.intercept_s,
        }


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds per GB, intercept s) of the least-squares line through (GB, s) points."""
    if len(points) < 2:
        raise ValueError(f"a fit needs at least two sizes, got {len(points)}")
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError("every size has the same number of bytes: nothing to fit")
    per_gb = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return per_gb, mean_y - per_gb * mean_x


def method_seconds(result: DtypeResult, method: str) -> float | None:
    """The median sync's total for `method` (the floor: the all-core memcpy), None if not run."""
    if method == "floor":
        return result.floor_s
    for measurement in result.measurements:
        if measurement.method == method and measurement.iterations:
            return measurement.typical().get("total")
    return None


def fit_sizes(results: list[DtypeResult]) -> list[Fit]:
    """One fit per (dtype, method) measured at two or more sizes."""
    fits = []
    for dtype in dict.fromkeys(r.dtype for r in results):
        for method in SIZE_METHODS:
            points = []
            for result in results:
                seconds = method_seconds(result, method) if result.dtype == dtype else None
                if seconds is not None:
                    points.append((result.num_bytes / 1e9, seconds))
            if len(points) < 2:
                continue
            points.sort()
            per_gb, intercept = fit_line(points)
            fits.append(Fit(method, dtype, points, per_gb, intercept))
    return fits


def format_sizes(results: list[DtypeResult], fits: list[Fit]) -> str:
    """Seconds per size and method, then each method's slope and intercept."""
    header = f"{'model':22s}  {'dtype':9s} {'GB':>5s}    "
    lines = [header + "  ".join(f"{m:>7}" for m in SIZE_METHODS)]
    for result in results:
        cells = []
        for method in SIZE_METHODS:
            seconds = method_seconds(result, method)
            cells.append(f"{seconds:7.3f}" if seconds is not None else f"{'':>7}")
        gb = result.num_bytes / 1e9
        lines.append(f"{result.preset:22s}  {result.dtype:9s} {gb:5.2f}    " + "  ".join(cells))
    lines.append("")
    lines.append("fit: seconds = intercept + GB / slope (least squares over the sizes)")
    for fit in fits:
        slope = f"{fit.slope_gbps:6.2f} GB/s" if fit.slope_gbps else "  not > 0  "
        lines.append(
            f"  {fit.dtype:9s} {fit.method:6s} slope {slope}  intercept {fit.intercept_s:+.3f} s"
            f"  ({len(fit.points)} sizes)"
        )
    return "\n".join(lines)


def plot_sizes(fits: list[Fit], path: Path, title: str) -> Path:
    """Seconds vs GB per method: the measured points and the fitted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(f.dtype for f in fits))
    figure, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for axis, dtype in zip(axes[0], dtypes, strict=True):
        for fit in (f for f in fits if f.dtype == dtype):
            xs = [x for x, _ in fit.points]
            ys = [y for _, y in fit.points]
            (line,) = axis.plot(xs, ys, "o")
            per_gb = fit.seconds_per_gb
            ends = [0.0, max(xs)]
            slope = f"{fit.slope_gbps:.2f} GB/s" if fit.slope_gbps else "no growth"
            axis.plot(
                ends,
                [fit.intercept_s + per_gb * x for x in ends],
                "-",
                color=line.get_color(),
                label=f"{fit.method}: {slope}, {fit.intercept_s:+.2f} s",
            )
        axis.set_xlabel("model bytes (GB)")
        axis.set_ylabel("seconds per sync (median)")
        axis.set_title(f"{title} ({dtype})")
        axis.set_xlim(left=0)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
