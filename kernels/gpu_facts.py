"""What the kernels' launch choices read of a GPU, read once per device: its SM count,
whether Triton's tensor descriptors lower to TMA there (Hopper or later), and the shared
memory one program may take. Each takes the tensor's device; on CPU (the Triton
interpreter, in tests) they answer fixed values, so the CUDA code paths run there too."""

from __future__ import annotations

import functools

import torch

#: SM count assumed on CPU (the interpreter): an H100/H200's, so plans match the GPU's.
INTERPRETER_SMS = 132


@functools.cache
def _facts(idx: int) -> tuple[int, bool, int]:
    """GPU ``idx``'s ``(SM count, TMA (compute capability 9 or later), shared memory one
    program may take in bytes (the opt-in maximum, as Triton's compiler checks it))``."""
    import triton

    props = torch.cuda.get_device_properties(idx)
    smem = triton.runtime.driver.active.utils.get_device_properties(idx)["max_shared_mem"]
    return props.multi_processor_count, props.major >= 9, smem


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    """SMs of ``device``'s GPU; ``INTERPRETER_SMS`` on CPU."""
    return _facts(_index(device))[0] if device.type == "cuda" else INTERPRETER_SMS


def has_tma(device: torch.device) -> bool:
    """Whether tensor descriptors lower to TMA here: a Hopper or later GPU, or the
    interpreter on CPU (which runs them as plain loads, so tests can take that path)."""
    return _facts(_index(device))[1] if device.type == "cuda" else True


def max_shared_memory(device: torch.device) -> int | None:
    """Shared memory one program may take on ``device``'s GPU, bytes; None on CPU (the
    interpreter has no limit)."""
    return _facts(_index(device))[2] if device.type == "cuda" else None
