"""Load generator parts: config, random dataset, arrivals, streaming client, metrics, report, runner.

The public entry point is :func:`bench.loadgen.runner.run_benchmark`.
"""

from bench.loadgen.config import BenchConfig
from bench.loadgen.runner import BenchResult, run_benchmark

__all__ = ["BenchConfig", "BenchResult", "run_benchmark"]
