"""The CPU kernels (``kernels/csrc/*.cpp``: paged decode attention, SiLU-and-mul, residual
add + RMSNorm, rotary), one C++ extension built on first use with
``torch.utils.cpp_extension`` (g++ and ninja; about a minute once, then loaded from the
build cache in ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``).

The build is tuned to this machine (``-march=native``; ``-fno-trapping-math`` and
``-fno-math-errno`` let GCC vectorize the exp, floor and sqrt loops); the extension's name
carries a hash of the CPU's model and flags, of the build flags and of the sources, so a
cache shared by different CPUs never loads a binary built for another.

The sources compile as one translation unit (``csrc/cpu_kernels.cpp`` includes the
others), so ATen's and pybind11's headers are parsed once: on a 2-core Xeon the build took
23 s of CPU (20 s user) against 39 s as three units (wall 23 s against 26 s), which counts
where the build shares the cores with other work (the test suite's first minutes).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
#: What is compiled: one translation unit that includes ``PARTS``.
SOURCES = ("cpu_kernels.cpp",)
PARTS = ("decode_attention_cpu.cpp", "elementwise_cpu.cpp", "bindings.cpp", "cpu_math.h")
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
    for name in (*SOURCES, *PARTS):
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
        name = f"inferq_cpu_kernels_{_build_tag()}"
    except OSError as exc:  # a source missing from an installed package
        log.warning("the CPU kernel sources are incomplete (%s): using the PyTorch references", exc)
        return None
    build_dir = _build_dir(name)
    built = build_dir is not None and (build_dir / f"{name}.so").exists()
    if not built:  # a worker is silent for this long otherwise (issue 19)
        log.info("building the C++ CPU kernels (kernels/csrc/: decode attention, SiLU-and-mul, add + RMSNorm, "
                 "rotary) for this CPU with g++ -march=native, once: CPU steps use them instead of the slower "
                 "PyTorch references. About a minute on 2 cores; then cached in %s", build_dir)
    t0 = time.perf_counter()
    try:
        with _build_lock(build_dir):
            module = cpp_extension.load(name=name, sources=[str(CSRC / source) for source in SOURCES],
                                        extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # compiler errors surface as RuntimeError
        log.warning("building the CPU kernels failed (%s): using the PyTorch references", exc)
        return None
    if not built:
        log.info("built the C++ CPU kernels in %.0f s", time.perf_counter() - t0)
    return module


def _build_dir(name: str) -> Path | None:
    """Where ``torch.utils.cpp_extension`` builds and caches extension ``name``
    (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions/<python>_<device>``),
    or None when torch does not say (its helper is private)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False))
    except (ImportError, TypeError, OSError):
        return None


@contextlib.contextmanager
def _build_lock(build_dir: Path | None) -> Iterator[None]:
    """Hold an ``flock`` on ``<build_dir>.flock`` around torch's build-or-load, and remove
    torch's own ``<build_dir>/lock`` when it is found under that lock.

    torch serialises builds with a lock *file* that its holder deletes when done; a process
    killed mid-build leaves it behind, and every later load then waits on it forever. The
    kernel releases an ``flock`` when its holder dies, so whoever holds ours knows that no
    other loader of this extension is running, and that a ``lock`` file it finds is stale.
    Raises ``OSError`` when the lock file cannot be opened."""
    if build_dir is None:
        yield
        return
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{build_dir.name}.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing a stale CPU-kernel build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def available() -> bool:
    """True when the kernels are built (or build now) on this machine."""
    return load() is not None
