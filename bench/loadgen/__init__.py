"""Load generator parts: config, random dataset, arrivals, streaming client, metrics, report, runner,
sweeps and their plots.

The public entry points are :func:`bench.loadgen.runner.run_benchmark` (one run) and
:func:`bench.loadgen.sweep.run_sweep` (one run per concurrency or request rate).
"""

from bench.loadgen.config import BenchConfig
from bench.loadgen.runner import BenchResult, run_benchmark
from bench.loadgen.sweep import SweepPlan, SweepResult, run_sweep

__all__ = ["BenchConfig", "BenchResult", "SweepPlan", "SweepResult", "run_benchmark", "run_sweep"]
