"""The `checkpoint:` section, and where complete checkpoints are on disk (no torch needed)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field

from vime.config.base import StrictModel

_STEP_DIR = re.compile(r"step_(\d+)$")


class CheckpointConfig(StrictModel):
    """When the trainer saves checkpoints, where, and whether the job resumes from one."""

    every_steps: int | None = Field(
        None, ge=1, description="Save after every N-th step; None: only at the end (at_end)."
    )
    at_end: bool = Field(True, description="Save after the last step.")
    dir: str | None = Field(None, description="Where checkpoints go; None: run_dir/checkpoints.")
    keep: int = Field(2, ge=1, description="Complete checkpoints kept (the newest).")
    resume: bool | str = Field(
        False,
        description=(
            "true: continue from the newest complete checkpoint in `dir` (none there: start "
            "fresh); a path: from that checkpoint (it must exist). The engines are synced to the "
            "resumed weights before the first rollout."
        ),
    )

    def root(self, run_dir: str | Path) -> Path:
        return Path(self.dir) if self.dir else Path(run_dir) / "checkpoints"

    def due(self, next_step: int, num_steps: int) -> bool:
        """Whether to save once `next_step` steps are done."""
        periodic = self.every_steps is not None and next_step % self.every_steps == 0
        return periodic or (self.at_end and next_step == num_steps)

    def resume_path(self, run_dir: str | Path) -> Path | None:
        """The checkpoint to resume from, or None; ValueError for a path that is no checkpoint."""
        if self.resume is False:
            return None
        if self.resume is True:
            return latest_checkpoint(self.root(run_dir))
        path = Path(self.resume)
        if not (path / "metadata.json").is_file():
            raise ValueError(
                f"checkpoint.resume={self.resume!r} is not a complete checkpoint (no "
                "metadata.json there): give a step_<K> directory, or true for the newest"
            )
        root = self.root(run_dir)
        newer = [p.name for p in complete_checkpoints(root) if _step(p) > _step(path)]
        if newer:
            raise ValueError(
                f"checkpoint.resume={self.resume!r} is older than checkpoints {newer} in {root}, "
                "which this run's saves would mix with and prune: move them away, or give "
                "checkpoint.dir a new directory"
            )
        return path


def _step(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else -1


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoints under `root` that were completely written, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    complete = [c for c in root.iterdir() if _step(c) >= 0 and (c / "metadata.json").is_file()]
    return sorted(complete, key=_step)


def latest_checkpoint(root: str | Path) -> Path | None:
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None
