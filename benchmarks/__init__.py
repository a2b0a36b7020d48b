"""Measured figures, each runnable alone: `python -m benchmarks.<name>`."""
