"""A GPU's utilization, memory, power draw and SM clock, sampled through NVML on a
background thread while a benchmark run goes, to show where the GPU idles and whether it
runs at its power limit (an H200 serving at full load draws its 700 W and lowers its SM
clock to ~1,590 of 1,980 MHz: docs/benchmarks.md, "Against vLLM on the same GPU").

NVML (the ``nvidia-ml-py`` package, module ``pynvml``): ``nvmlDeviceGetUtilizationRates``
gives the percent of the last sample period (between 1/6 s and 1 s, by product) in which
one or more kernels ran; ``nvmlDeviceGetMemoryInfo`` the bytes in use on the device, by
every process; ``nvmlDeviceGetPowerUsage`` the board's draw in milliwatts;
``nvmlDeviceGetClockInfo(..., NVML_CLOCK_SM)`` the SM clock in MHz. A GPU that does not
report power or clocks gives ``None`` for them. NVML counts devices in PCI order,
whatever ``CUDA_VISIBLE_DEVICES`` says.

Where NVML cannot be used (the package or the driver's library is missing, no GPU, or an
NVML error while sampling), the trace is empty, ``reason`` says why, and the reason is
logged once per process: a run never fails for want of a GPU trace.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
_said: set[str] = set()  # reasons already logged in this process


@dataclass(frozen=True, slots=True)
class GPUSample:
    """One reading: ``t_s`` (``time.perf_counter``, s), utilization (%), memory used
    (bytes), power draw (W) and SM clock (MHz), the last two ``None`` where the GPU does
    not report them."""

    t_s: float
    util_pct: int
    mem_used_bytes: int
    power_w: float | None = None
    sm_clock_mhz: int | None = None


class GPUSampler:
    """Samples GPU ``device_index`` (NVML's numbering) every ``interval_s`` seconds between
    ``start`` and ``stop``. ``device_name``: the GPU's name once started (None without
    NVML); ``reason``: why the trace is empty or ends early (None when it is whole)."""

    def __init__(self, device_index: int = 0, interval_s: float = 0.1) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.device_index = device_index
        self.interval_s = interval_s
        self.device_name: str | None = None
        self.reason: str | None = None
        self._samples: list[GPUSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None

    def start(self) -> GPUSampler:
        """Open NVML and start the sampling thread; without NVML, only set ``reason``.
        Returns self."""
        try:
            import pynvml
        except ImportError:
            return self._unavailable("no NVML bindings (pip install nvidia-ml-py)")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return self._unavailable(f"NVML did not start: {exc}")
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
            name = pynvml.nvmlDeviceGetName(handle)
            self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            return self._unavailable(f"no GPU {self.device_index} in NVML: {exc}")
        self._nvml = pynvml
        self._thread = threading.Thread(target=self._run, args=(handle,), name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def _unavailable(self, reason: str) -> GPUSampler:
        self.reason = reason
        if reason not in _said:
            _said.add(reason)
            log.warning("no GPU trace: %s", reason)
        return self

    def _run(self, handle: Any) -> None:
        nvml = self._nvml
        next_s = time.perf_counter()
        while not self._stop.is_set():
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                used = nvml.nvmlDeviceGetMemoryInfo(handle).used
            except nvml.NVMLError as exc:
                self._unavailable(f"NVML failed while sampling: {exc}")
                return
            power_w = clock_mhz = None
            try:
                power_w = nvml.nvmlDeviceGetPowerUsage(handle) / 1e3
                clock_mhz = int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
            except nvml.NVMLError:
                pass  # not reported by this GPU: the sample keeps None
            self._samples.append(GPUSample(time.perf_counter(), int(util), int(used), power_w, clock_mhz))
            next_s += self.interval_s  # a fixed schedule: a slow read does not shift the ones after it
            self._stop.wait(max(next_s - time.perf_counter(), 0.0))

    def samples(self) -> list[GPUSample]:
        """The samples so far, in time order (sampling goes on)."""
        return list(self._samples)

    def stop(self) -> list[GPUSample]:
        """Stop sampling, close NVML; returns the samples in time order (empty without NVML)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._nvml.nvmlShutdown()
        return list(self._samples)


def trace_columns(samples: Sequence[GPUSample], origin_s: float, start_s: float | None = None,
                  end_s: float | None = None) -> dict[str, list[Any]]:
    """The samples taken in ``[start_s, end_s]`` (perf_counter; None: no bound) as columns
    for a result file: ``t_s`` (seconds after ``origin_s``), ``util_pct``,
    ``mem_used_bytes``, ``power_w`` and ``sm_clock_mhz`` (``None`` entries where not reported)."""
    kept = [s for s in samples if (start_s is None or s.t_s >= start_s) and (end_s is None or s.t_s <= end_s)]
    return {"t_s": [round(s.t_s - origin_s, 4) for s in kept], "util_pct": [s.util_pct for s in kept],
            "mem_used_bytes": [s.mem_used_bytes for s in kept],
            "power_w": [None if s.power_w is None else round(s.power_w, 1) for s in kept],
            "sm_clock_mhz": [s.sm_clock_mhz for s in kept]}


def busy_power_clock(samples: Sequence[GPUSample], min_util_pct: int = 90) -> dict[str, float]:
    """Median power draw (W) and SM clock (MHz) over the samples at ``min_util_pct`` or
    more utilization, where both were reported; ``{}`` when none was."""
    busy = [s for s in samples if s.util_pct >= min_util_pct and s.power_w is not None and s.sm_clock_mhz is not None]
    if not busy:
        return {}
    return {"busy_power_median_w": statistics.median(s.power_w for s in busy),  # type: ignore[misc]
            "busy_sm_clock_median_mhz": statistics.median(s.sm_clock_mhz for s in busy)}  # type: ignore[misc]
