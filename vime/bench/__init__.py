"""Benchmarks that print figures: `vime bench-sync` (weight sync vs its floor and baselines)."""
