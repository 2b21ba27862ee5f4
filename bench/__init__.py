"""Benchmarks: `holdfast bench <name>`; results are written up in docs/."""
