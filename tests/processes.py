"""Start inferq's real processes (gateway, workers) for integration tests.

The helpers live in :mod:`bench.procs`, shared with the benchmarks; this module keeps the
names the tests import.
"""

from __future__ import annotations

import subprocess  # noqa: F401 - tests annotate with ``processes.subprocess.Popen``

from bench.procs import ROOT, cpu_s, free_port, start, stop, wait_for_gateway, wait_for_workers

__all__ = ["ROOT", "cpu_s", "free_port", "start", "stop", "wait_for_gateway", "wait_for_workers"]
