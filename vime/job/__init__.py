"""vime's own RL job, in rooms: `preflight` (every path and function of a config checked before
anything starts), `abort` (end a rank at once, from any thread), `faults` (engine fault
tolerance, both halves), `stages` (the supervised warm start and the held-out evaluation),
`report` (metrics rows, the step line, the summary), `loop` (the algorithm) and `run` (set up
the trainer, the engines and the sync through `vime.plugin`, run the loop, tear down).
`vime.train` is the entry point.
"""
