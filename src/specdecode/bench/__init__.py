"""The benchmark harness behind ``specdecode bench``."""

from .runner import BenchConfig, resummarize, run_bench

__all__ = ["BenchConfig", "resummarize", "run_bench"]
