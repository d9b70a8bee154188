"""Known-harmless dependency warnings, silenced once at the start of a vime job.

On a CPU machine megatron-core warns at import that Transformer Engine and Apex are missing (it
falls back to torch's kernels and optimizers, which is what vime uses there) and that a CUDA-graph
scope default is deprecated (vime captures no graphs). Each filter names its exact message, so
any other warning still shows. Imports nothing of vime.
"""

from __future__ import annotations

import warnings

KNOWN_HARMLESS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
)


def quiet_known_warnings() -> None:
    for message in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message + ".*")
