"""The CPU kernels (``kernels/csrc/*.cpp``: paged decode attention, SiLU-and-mul, residual
add + RMSNorm, rotary), one C++ extension built on first use with
``torch.utils.cpp_extension`` (g++ and ninja; about a minute once, then loaded from the
build cache in ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``).

The build is tuned to this machine (``-march=native``; ``-fno-trapping-math`` and
``-fno-math-errno`` let GCC vectorize the exp, floor and sqrt loops); the extension's name
carries a hash of the CPU's model and flags, of the build flags and of the sources, so a
cache shared by different CPUs never loads a binary built for another.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("decode_attention_cpu.cpp", "elementwise_cpu.cpp", "bindings.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-trapping-math", "-fno-math-errno"]


def _build_tag() -> str:
    """Short hash of the CPU's model name and flags (from /proc/cpuinfo, when readable),
    of the compiler flags and of the sources."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = sorted({line for line in lines if line.startswith(("model name", "flags", "cpu family", "model\t"))})
    digest = hashlib.sha1("\n".join([*wanted, *_CFLAGS]).encode())
    for name in (*SOURCES, "cpu_math.h"):
        digest.update((CSRC / name).read_bytes())
    return digest.hexdigest()[:10]


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or ``None`` where it cannot be built (no C++ compiler or
    ninja, or the build failed; logged once). Cached per process."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        log.warning("no C++ compiler: the CPU kernels fall back to the PyTorch references")
        return None
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        log.warning("ninja is not installed: the CPU kernels fall back to the PyTorch references")
        return None
    try:
        return cpp_extension.load(name=f"inferq_cpu_kernels_{_build_tag()}",
                                  sources=[str(CSRC / name) for name in SOURCES],
                                  extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # compiler errors surface as RuntimeError
        log.warning("building the CPU kernels failed (%s): using the PyTorch references", exc)
        return None


def available() -> bool:
    """True when the kernels are built (or build now) on this machine."""
    return load() is not None
