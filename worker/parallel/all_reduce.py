"""The tensor-parallel all-reduce: our one-shot kernel over NVLink peer buffers for
decode-sized messages (``kernels/all_reduce.py``), NCCL for the rest and off CUDA.

``CustomAllReduce`` allocates one symmetric buffer per group at start
(``torch.distributed._symmetric_memory``: the same size on every rank, each rank's
buffer mapped into every other's address space through CUDA IPC; its CUDA backend,
multicast off as ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` keeps it), so the addresses a
kernel reads are fixed and a call is captured in CUDA graphs like any other kernel. A
call copies the input into this rank's buffer and runs the kernel, which writes the sum
back into the input. Messages over ``max_bytes`` go to NCCL: past about a megabyte the
one-shot read of W buffers by every rank costs more than NCCL's bandwidth-bound ring.

``all_reduce(x, group)`` is what the layers call (``worker/parallel/layers.py``); it
takes the custom path when this process's group set one up (``install``) and the
message fits, the same decision on every rank (it depends on shape and dtype only).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: Largest message the one-shot kernel takes, bytes, by world size (vLLM's custom
#: all-reduce switches at about the same sizes); larger ones go to NCCL.
MAX_BYTES = {2: 2 * 1024**2, 4: 1024**2, 8: 512 * 1024}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_installed: CustomAllReduce | None = None


class CustomAllReduce:
    """One-shot all-reduce over a symmetric buffer of ``max_bytes`` for ``group``'s ranks
    (module docstring). Build it on every rank at once (the rendezvous is collective).

    Raises:
        RuntimeError: symmetric memory cannot be set up here (no peer access between
            these GPUs, or torch without it): the caller falls back to NCCL.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from kernels.all_reduce import one_shot_all_reduce

        self._kernel = one_shot_all_reduce
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.max_bytes = max_bytes
        try:
            symm_mem.set_backend("CUDA")
        except Exception as exc:  # noqa: BLE001 - already set (or one backend only): keep it
            log.debug("symmetric memory backend kept: %s", exc)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.buffer.zero_()
        self._buffer_ptrs = int(self.handle.buffer_ptrs_dev)
        self._pad_ptrs = int(self.handle.signal_pad_ptrs_dev)
        self._pad_bytes = int(self.handle.signal_pad_size)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through this all-reduce (CUDA, contiguous, a float dtype, at
        most ``max_bytes``)."""
        return (x.is_cuda and x.dtype in _DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group's ranks, in place; returns ``x``.

        Raises:
            ValueError: ``x`` does not ``fit``.
        """
        if not self.fits(x):
            raise ValueError(f"{tuple(x.shape)} {x.dtype} does not fit the one-shot all-reduce")
        return self._reduce(x)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``__call__`` for an ``x`` known to fit."""
        self.buffer[:x.numel() * x.element_size()].view(x.dtype).copy_(x.view(-1))
        return self._kernel(x, self._buffer_ptrs, self._pad_ptrs, self._pad_bytes, self.rank, self.world_size)


def install(group: dist.ProcessGroup, device: torch.device, first_group: bool = True) -> CustomAllReduce | None:
    """Set up the one-shot all-reduce for this process's tensor-parallel ``group`` on CUDA
    (every rank calls it at the same point); None, logged, where it cannot run (not
    CUDA, a world size without a ``MAX_BYTES`` entry, GPUs without peer access, no
    symmetric memory, or a rank whose process had a group before, ``first_group`` False):
    ``all_reduce`` then takes NCCL for everything.

    The last case is a process that builds a second engine after closing the first (tests,
    benchmarks; a worker has one group): on 2 H200s (2026-11-28) its rendezvous of the
    peer buffers waited forever for the new followers, which had joined theirs under
    other keys (torch names a process's groups in the order it makes them).
    """
    global _installed
    _installed = None
    world = dist.get_world_size(group)
    if device.type != "cuda" or world not in MAX_BYTES:
        return None
    if not _all_agree(first_group, group, device):
        log.info("tensor parallel: a second group in this process; all-reduce through NCCL only")
        return None
    # Rank r runs on GPU r (worker/parallel/group.py). Every rank must decide alike, or
    # one would wait in the kernel for a peer that went to NCCL: the ranks agree first.
    peers = [r for r in range(world) if r != device.index]
    ok = all(torch.cuda.can_device_access_peer(device.index, p) for p in peers)
    if not _all_agree(ok, group, device):
        log.info("tensor parallel: GPUs without peer access; all-reduce through NCCL only")
        return None
    custom = None
    try:
        custom = CustomAllReduce(group, device, MAX_BYTES[world])
    except Exception as exc:  # noqa: BLE001 - symmetric memory unavailable: NCCL does it all
        log.warning("tensor parallel: one-shot all-reduce unavailable here: %s", exc)
    if not _all_agree(custom is not None, group, device):
        log.info("tensor parallel: one-shot all-reduce not set up on every rank; NCCL only")
        return None
    _installed = custom
    log.info("tensor parallel: one-shot all-reduce up to %d KiB over peer buffers", MAX_BYTES[world] // 1024)
    return _installed


def _all_agree(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (a MIN all-reduce through NCCL)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def uninstall() -> None:
    """Drop this process's one-shot all-reduce (the group is leaving)."""
    global _installed
    _installed = None


def installed() -> CustomAllReduce | None:
    """This process's one-shot all-reduce, or None."""
    return _installed


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (the one-shot kernel where installed and ``x``
    fits, else ``dist.all_reduce``); returns ``x``."""
    custom = _installed
    if custom is not None and custom.fits(x):
        return custom._reduce(x)
    dist.all_reduce(x, group=group)
    return x
