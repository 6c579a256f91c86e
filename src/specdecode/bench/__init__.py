"""The benchmark harness behind ``specdecode bench``."""

from .runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench"]
