"""Benchmarks of the gateway against baselines in the same run: ``python -m benchmarks``."""
