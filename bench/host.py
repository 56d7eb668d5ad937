"""What a CPU benchmark ran on, in one line for result files: benchmarks on a shared
host are only comparable between runs on the same CPU model."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_description() -> str:
    """``"<model name> (family F, model M), N cores, <SIMD extensions>"`` from
    /proc/cpuinfo (``platform.machine()`` alone where it is not readable); SIMD lists
    the AVX-512/AMX extensions that matter to float32 and bfloat16 GEMMs."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    ident = f" (family {fields['cpu family']}, model {fields['model']})" if "cpu family" in fields else ""
    flags = fields.get("flags", "").split()
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}{ident}, {os.cpu_count()} cores" + (f", {' '.join(simd)}" if simd else "")
