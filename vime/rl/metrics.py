"""Run metrics: one JSONL line per step, TensorBoard scalars, a PNG of the curves and a summary.

    writer = MetricsWriter(run_dir)
    writer.log(step, {**batch.metrics(trainer_version), **prefixed(loss_metrics, "train/"),
                      "sync/time_s": report.total_s})
    writer.close()   # writes metrics.png and summary.txt next to metrics.jsonl and the TB events

Keys are "<section>/<name>". The plot shows reward, weight-sync time, staleness and the log-prob
diff between trainer and engine: the four curves an async RL run is judged by.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REWARD_KEY = "rollout/reward_mean"
SYNC_TIME_KEY = "sync/time_s"
CHANGED_KEY = "sync/changed_fraction"
LAG_KEY = "staleness/lag_mean"
LOGPROB_DIFF_KEY = "train/logprob_diff"
KL_REF_KEY = "train/kl_ref"
EVAL_KEY = "eval/pass_at_1"
# The model behind a held-out evaluation (eval.jsonl "stage"): (plot label, summary name).
EVAL_STAGES = {
    "before": ("base", "initial model"),
    "resumed": ("resumed", "resumed checkpoint"),
    "after_sft": ("SFT", "after SFT"),
    "after": ("RL", "after RL"),
}

# (panel title, keys drawn in it)
PLOT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward (rollouts); held-out greedy pass@1", (REWARD_KEY, EVAL_KEY)),
    ("weight sync time (s); delta: changed share of elements", (SYNC_TIME_KEY, CHANGED_KEY)),
    ("staleness (versions)", (LAG_KEY, "staleness/lag_max", "staleness/version_span_mean")),
    # |train - rollout|: the online check that sync is exact; KL to the reference (kl_coef > 0).
    ("policy drift", (LOGPROB_DIFF_KEY, KL_REF_KEY)),
)


def prefixed(metrics: Mapping[str, float], prefix: str) -> dict[str, float]:
    """{"loss": 1} -> {"train/loss": 1}."""
    return {f"{prefix}{key}": value for key, value in metrics.items()}


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The JSON lines of `path` ([] if absent); a line cut short by a killed run is skipped."""
    path = Path(path)
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def drop_rows_from(path: str | Path, step: int) -> None:
    """Keep only the rows of `path` before `step`: what a run resumed at `step` writes again."""
    path = Path(path)
    if path.exists():
        kept = [row for row in read_rows(path) if row.get("step", -1) < step]
        path.write_text("".join(json.dumps(row) + "\n" for row in kept))


class MetricsWriter:
    """Writes metrics.jsonl, TensorBoard events (tb/), and on close metrics.png and summary.txt."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, resume: bool = False):
        """`resume`: a resumed job's writer; its plot and summary include the rows the earlier
        run wrote. A fresh run in the same run_dir appends to the files but shows its own rows."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.plot_path = self.run_dir / "metrics.png"
        self.summary_path = self.run_dir / "summary.txt"
        # Held-out evaluations (eval.jsonl): a few rows, apart from the per-step metrics.
        self.eval_path = self.run_dir / "eval.jsonl"
        self.history: list[dict[str, Any]] = read_rows(self.jsonl_path) if resume else []
        self.eval_history: list[dict[str, Any]] = read_rows(self.eval_path) if resume else []
        self._jsonl = self.jsonl_path.open("a")
        if self._jsonl.tell() and not self.jsonl_path.read_bytes().endswith(b"\n"):
            self._jsonl.write("\n")  # end the cut line: the next row starts on its own
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        bad = {k: v for k, v in metrics.items() if not isinstance(v, (int, float))}
        if bad:
            raise ValueError(f"step {step}: metrics must be numbers, got {bad}")
        row = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        self.history.append(row)
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)

    def log_eval(self, step: int, metrics: Mapping[str, float], stage: str = "") -> None:
        """One held-out evaluation, taken before `step` runs (after the last step: num_steps);
        `stage` names the model evaluated (before, resumed, after_sft, after)."""
        row: dict[str, Any] = {"step": step, "time": time.time()}
        if stage:
            row["stage"] = stage
        row.update({k: float(v) for k, v in metrics.items()})
        self.eval_history.append(row)
        with self.eval_path.open("a") as out:
            out.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one key, skipping steps that did not log it or logged NaN."""
        points = [
            (int(row["step"]), row[key])
            for row in [*self.history, *self.eval_history]
            if key in row and not math.isnan(row[key])
        ]
        return [s for s, _ in points], [v for _, v in points]

    def plot(self, path: str | Path | None = None) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot

        path = Path(path) if path is not None else self.plot_path
        figure, axes = pyplot.subplots(2, 2, figsize=(11, 7), squeeze=False)
        for axis, (title, keys) in zip(axes.flat, PLOT_PANELS, strict=True):
            drawn = False
            for key in keys:
                steps, values = self.series(key)
                if steps:
                    # Held-out evaluations are a few points in time: markers on a dashed line.
                    style = {"marker": "o", "linestyle": "--"} if key == EVAL_KEY else {}
                    axis.plot(steps, values, **{"marker": ".", "label": key, **style})
                    drawn = True
                    if key == EVAL_KEY:
                        self._label_eval_points(axis)
            if drawn:
                axis.legend(fontsize=7)
            else:
                axis.text(
                    0.5, 0.5, "not logged", ha="center", va="center", transform=axis.transAxes
                )
            axis.set_title(title)
            axis.set_xlabel("step")
            axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        pyplot.close(figure)
        return path

    def _label_eval_points(self, axis: Any) -> None:
        """Name the model behind each held-out point (base, SFT, RL): two share step 0."""
        for row in self.eval_history:
            if EVAL_KEY in row and row.get("stage") in EVAL_STAGES:
                axis.annotate(
                    EVAL_STAGES[row["stage"]][0],
                    (row["step"], row[EVAL_KEY]),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )

    def summary(self) -> str:
        """A few lines: steps, reward first -> last, sync time, staleness, log-prob diff."""
        lines = [f"steps logged: {len(self.history)}"]
        _, rewards = self.series(REWARD_KEY)
        if rewards:
            window = max(1, min(5, len(rewards) // 4 or 1))
            first = sum(rewards[:window]) / window
            last = sum(rewards[-window:]) / window
            lines.append(
                f"reward: {first:.3f} -> {last:.3f} (mean of first/last {window} steps), "
                f"best {max(rewards):.3f}"
            )
        evals = [row for row in self.eval_history if EVAL_KEY in row]
        if evals:
            points = ", ".join(
                f"{row[EVAL_KEY]:.3f} {EVAL_STAGES[row['stage']][1]} (before step {row['step']})"
                if row.get("stage") in EVAL_STAGES
                else f"{row[EVAL_KEY]:.3f} before step {row['step']}"
                for row in evals
            )
            lines.append(f"held-out greedy pass@1: {points}")
        for label, key in (
            ("weight sync time (s)", SYNC_TIME_KEY),
            ("staleness lag (versions)", LAG_KEY),
            ("log-prob diff", LOGPROB_DIFF_KEY),
        ):
            _, values = self.series(key)
            if values:
                lines.append(
                    f"{label}: mean {sum(values) / len(values):.4g}, max {max(values):.4g}"
                )
        return "\n".join(lines)

    def close(self) -> None:
        if self._jsonl.closed:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        self.plot()
        self.summary_path.write_text(self.summary() + "\n")

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
