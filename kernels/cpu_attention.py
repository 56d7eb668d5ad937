"""Paged decode attention on CPU, a C++ kernel (``kernels/csrc/decode_attention_cpu.cpp``)
built on first use with ``torch.utils.cpp_extension`` (g++ and ninja; about 40 s once,
then loaded from the build cache in ``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``).

The PyTorch reference gathers each sequence's blocks into a padded tensor
(``index_select``) before one SDPA call: every K/V byte is read twice and written once.
The kernel reads K/V in place through the block table, one task per (decode token, KV
head), so a decode step's attention costs one pass over the context. Prefill chunks stay
on SDPA's flash kernel (``paged_attention_ref``), which is compute-bound and fast there.

The build is tuned to this machine (``-march=native``); the extension's name carries a
hash of the CPU's model and flags, so a cache shared by different CPUs never loads a
binary built for another.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention_cpu.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]


def _cpu_tag() -> str:
    """Short hash of the CPU's model name and flags (from /proc/cpuinfo, when readable)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags", "cpu family", "model\t"))]
    return hashlib.sha1("\n".join(sorted(set(wanted))).encode()).hexdigest()[:10]


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled kernel module, or ``None`` where it cannot be built (no C++ compiler
    or ninja, or the build failed; logged once). Cached per process."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        log.warning("no C++ compiler: CPU decode attention falls back to the PyTorch reference")
        return None
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        log.warning("ninja is not installed: CPU decode attention falls back to the PyTorch reference")
        return None
    try:
        return cpp_extension.load(name=f"inferq_decode_attention_cpu_{_cpu_tag()}", sources=[str(SOURCE)],
                                  extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # compiler errors surface as RuntimeError
        log.warning("building the CPU decode attention kernel failed (%s): using the PyTorch reference", exc)
        return None


def available() -> bool:
    """True when the kernel is built (or builds now) on this machine."""
    return load_extension() is not None


def decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, token_idx: torch.Tensor,
                     seq_idx: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of single query tokens over their sequences' paged K/V, written into
    ``out`` in place (other rows of ``out`` untouched); returns ``out``.

    Args:
        out, q: ``[num_tokens, num_heads, head_dim]`` float32 or bfloat16, each token's
            heads contiguous (row stride may differ).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous,
            q's dtype; ``num_heads`` a multiple of ``num_kv_heads`` (GQA).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        seq_lens: ``[num_seqs]`` int32, context length of each sequence (tokens),
            this step's token included (already written to the cache).
        token_idx, seq_idx: ``[n]`` int32: row of each decode token in ``q``/``out`` and
            the sequence it belongs to.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Raises:
        RuntimeError: the kernel is not available here (see ``available``), or shapes,
            strides or dtypes do not match.
    """
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the CPU decode attention kernel is not built on this machine")
    ext.decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, token_idx, seq_idx, scale)
    return out
