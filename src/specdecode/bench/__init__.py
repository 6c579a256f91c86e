"""The benchmark harness behind ``specdecode bench``."""

from specdecode.bench.runner import BenchConfig, resummarize, run_bench

__all__ = ["BenchConfig", "resummarize", "run_bench"]
