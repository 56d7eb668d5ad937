"""The garbage collector and a long-lived server process's startup heap."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move every object alive now into the collector's permanent generation (``gc.freeze``).

    A gateway's or a worker's startup heap (torch and transformers modules, the tokenizer,
    the model's modules: hundreds of thousands of objects) lives until exit, but each full
    collection walks all of it: 0.1-0.5 s per pass on a 2-core CPU, and on the H100 host
    stalls of ~50 ms in the worker's step loop (docs/benchmarks.md, "Scheduling ahead"),
    triggered again and again by the objects that requests keep alive for a few seconds.
    Frozen, a full pass walks only what serving allocated. vLLM freezes its API server's
    and its engine core's startup heaps the same way; docs/operations.md, "Gateway CPU per
    token".
    """
    gc.collect()
    gc.freeze()
