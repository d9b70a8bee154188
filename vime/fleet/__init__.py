"""The elastic fleet: engines that join a running job (by schedule, CLI request or a scale-up
policy), get the current weights (from a live engine or the trainer) and are verified before they
serve; engines that drain and leave; preemption notices turned into drains.

- `fleet`: `Fleet`, what the job's loop calls at its safe points (before and after each sync).
- `preemption`: SIGTERM'd engines (a preemption notice) become drains.
- `requests`: `vime fleet`, the file a running job reads its join/drain requests from.
- `first_weights`: a joiner's first weights, engine to engine or from the trainer.
- `stats`: what it counts, for the metrics rows and the summary.
"""
