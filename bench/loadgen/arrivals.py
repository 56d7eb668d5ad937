"""Request arrival times: a Poisson process (or a burstier/smoother gamma process).

Gaps between arrivals are gamma distributed with shape ``burstiness`` and mean
``1/request_rate_per_s`` (as ``vllm bench serve`` does). ``burstiness`` 1 gives exponential
gaps, i.e. Poisson arrivals; below 1 is burstier, above 1 more regular. The first request
leaves at 0 s; an infinite rate sends everything at 0 s.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets_s(num_requests: int, request_rate_per_s: float, burstiness: float, seed: int) -> np.ndarray:
    """Send time of each request in seconds after the benchmark starts; shape ``(num_requests,)``.

    Offsets are cumulative (sleeping until each absolute time keeps sleep overshoot from
    piling up over a long run).
    """
    assert num_requests >= 1 and request_rate_per_s > 0.0 and burstiness > 0.0
    if math.isinf(request_rate_per_s):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    scale_s = 1.0 / (request_rate_per_s * burstiness)  # gamma mean = shape * scale = 1 / rate
    gaps_s = rng.gamma(shape=burstiness, scale=scale_s, size=num_requests - 1)
    return np.concatenate(([0.0], np.cumsum(gaps_s)))
