"""The elastic fleet (`fleet:`): engines that join and leave a running job."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vime.config.base import StrictModel


class FleetChange(StrictModel):
    """At the safe point before step `step`'s sync: launch `join` more engines, drain `leave`."""

    step: int = Field(ge=0, description="The step whose sync the change precedes.")
    join: int = Field(0, ge=0, description="Engines to launch (they serve once synced).")
    wait: bool = Field(
        False,
        description="The safe point waits until the joiners are up, so they take this step's "
        "sync (training waits; the engines go on generating). Default: they join at the first "
        "safe point after they are up.",
    )
    leave: list[int] = Field(
        default_factory=list,
        description="Engine indices to drain: no new requests, those in flight finish, then the "
        "engine leaves every later sync and ends.",
    )

    @model_validator(mode="after")
    def _something(self) -> FleetChange:
        if not self.join and not self.leave:
            raise ValueError(f"fleet change at step {self.step} neither joins nor leaves")
        return self


class ScaleUpPolicy(StrictModel):
    """Launch engines when the rollouts are behind: the trainer waited longer than `wait_s` for
    its batch at each of the last `steps` steps (with rollout.max_staleness >= 1 a batch is
    generated while the trainer trains on the one before, so any wait is generation the engines
    did not finish)."""

    wait_s: float = Field(ge=0, description="A step whose batch the trainer waited for longer.")
    steps: int = Field(2, ge=1, description="Consecutive such steps before a launch.")
    add: int = Field(1, ge=1, description="Engines launched each time (up to max_engines).")
    wait: bool = Field(False, description="As FleetChange.wait: the safe point waits for them.")

    def is_behind(self, waits: list[float]) -> bool:
        """Whether the trainer's last waits for its batches (seconds, oldest first) ask for more
        engines."""
        return len(waits) >= self.steps and all(w > self.wait_s for w in waits[-self.steps :])


class FleetConfig(StrictModel):
    """Engines join and leave while the job runs (launched engines only).

    Changes come from `schedule`, from `scale_up` and from `vime fleet join|leave --run-dir DIR`
    (requests the job reads at each step's safe point). A joiner starts in the background while
    training goes on, and at the first safe point after it is up it gets its first weights
    (`first_weights`), then takes that step's sync, verified by checksums with
    `weight_sync.verify_checksums`; only then does it get requests. A leaver gets no new request
    at once, finishes the ones in flight (still synced every step, so their tokens keep exact
    versions), then leaves.
    """

    schedule: list[FleetChange] = Field(default_factory=list)
    scale_up: ScaleUpPolicy | None = Field(
        None, description="Launch engines when the rollouts are behind (None: never)."
    )
    max_engines: int = Field(8, ge=1, description="Joins beyond this many engines are refused.")
    first_weights: Literal["auto", "engine", "trainer"] = Field(
        "auto",
        description="How a joiner gets the current weights. 'engine': a serving engine sends "
        "them (engine to engine over gloo, checksums compared), and the step's sync stays a "
        "delta for every engine; needs weight_sync.transport.delta (otherwise, or if the copy "
        "fails, 'trainer'). 'trainer': the step's sync is full, for every engine. 'auto': "
        "'engine' unless this job's full syncs were faster than its delta syncs (medians).",
    )
    drain_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A leaver whose requests have not finished by then has them cancelled and "
        "resubmitted to the other engines.",
    )
