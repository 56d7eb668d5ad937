"""One-shot all-reduce over peer-to-peer GPU buffers (NVLink), for decode-sized messages.

At the sizes of a decode step's all-reduces (batch x hidden size x 2 bytes: 8 KiB to a
few MiB) NCCL's ring spends most of its time on latency: 2 (W - 1) steps, each a
round of signalling. Here every rank has written its input into its own buffer of a
symmetric allocation (the same size on every rank, each rank able to read every other's
through CUDA IPC mappings: ``torch.distributed._symmetric_memory``, multicast off), and
one kernel per rank:

1. signals every peer that its buffer is written, and waits for every peer's signal
   (a barrier per program, through per-program flags in each rank's signal pad);
2. reads its share of the elements from all W buffers, adds them in rank order in
   float32 and writes the sum to its output, so every rank gets the same bits;
3. signals and waits once more, so that no rank's next call overwrites its buffer while
   a peer still reads it.

The flags are 32-bit words ``pad[program * W + source]`` in each rank's signal pad, all
0 at rest: a rank raises its flag in a peer's pad with a compare-and-swap 0 -> 1 at
system scope with release semantics (spinning while the peer has not yet taken the
previous one), and takes each peer's flag in its own pad with a compare-and-swap 1 -> 0
with acquire semantics. Each barrier raises and takes each flag exactly once, so the
pads are back to 0 after every call, and a kernel captured in a CUDA graph replays as it ran.

This is the "one-shot" algorithm of vLLM's, SGLang's and TensorRT-LLM's custom
all-reduces (vLLM ``csrc/custom_all_reduce.cuh``; TensorRT-LLM
``customAllReduceKernels.cu``), written for Triton with scalar atomics: one thread of a
program raises or takes each flag, ``tl.debug_barrier`` holds the program's other
threads until it has.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Elements each program reads per buffer and loop step.
BLOCK = 2048
#: Most programs of one launch (each holds 2 W flags; more programs read faster, each
#: also waits on every peer).
MAX_PROGRAMS = 32


@triton.jit
def _barrier(pad_ptrs, rank, WORLD: tl.constexpr):
    """Raise this program's flag in every rank's pad, then take every rank's flag in ours."""
    pid = tl.program_id(0)
    pads = pad_ptrs.to(tl.pointer_type(tl.uint64))
    own = tl.load(pads + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        theirs = tl.load(pads + peer).to(tl.pointer_type(tl.int32))
        flag = theirs + pid * WORLD + rank
        while tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0:
            pass
    for peer in tl.static_range(WORLD):
        flag = own + pid * WORLD + peer
        while tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()


@triton.jit
def _one_shot_kernel(buffer_ptrs, pad_ptrs, out_ptr, numel, rank, WORLD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    _barrier(pad_ptrs, rank, WORLD)
    bufs = buffer_ptrs.to(tl.pointer_type(tl.uint64))
    dtype = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_SIZE
    for start in range(pid * BLOCK_SIZE, numel, step):
        offs = start + tl.arange(0, BLOCK_SIZE)
        mask = offs < numel
        acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            src = tl.load(bufs + r).to(tl.pointer_type(dtype))
            acc += tl.load(src + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(dtype), mask=mask)
    _barrier(pad_ptrs, rank, WORLD)


def num_programs(numel: int, world_size: int, signal_pad_bytes: int) -> int:
    """Programs of a launch over ``numel`` elements: one per ``BLOCK`` elements, at most
    ``MAX_PROGRAMS`` and at most what the signal pad holds (``W`` int32 flags each)."""
    return max(1, min(triton.cdiv(numel, BLOCK), MAX_PROGRAMS, signal_pad_bytes // (4 * world_size)))


def one_shot_all_reduce(out: torch.Tensor, buffer_ptrs_dev: int, signal_pad_ptrs_dev: int, signal_pad_bytes: int,
                        rank: int, world_size: int) -> torch.Tensor:
    """Sum over ranks of the first ``out.numel()`` elements of every rank's symmetric
    buffer (each rank wrote its input there, in ``out``'s dtype), written to ``out``
    (contiguous, CUDA, bfloat16/float16/float32; may be any tensor, also this rank's
    buffer itself). Every rank of the group must make the same call, in the same order.

    ``buffer_ptrs_dev`` / ``signal_pad_ptrs_dev``: device addresses of the arrays of the W
    ranks' buffer and signal-pad addresses (``_SymmetricMemory.buffer_ptrs_dev``,
    ``signal_pad_ptrs_dev``); ``signal_pad_bytes`` their signal pads' size.

    Raises:
        ValueError: ``out`` not contiguous or of another dtype.
    """
    if not out.is_contiguous():
        raise ValueError("the all-reduce output must be contiguous")
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"no one-shot all-reduce for {out.dtype}")
    numel = out.numel()
    grid = (num_programs(numel, world_size, signal_pad_bytes),)
    _one_shot_kernel[grid](buffer_ptrs_dev, signal_pad_ptrs_dev, out, numel, rank, WORLD=world_size,
                           BLOCK_SIZE=BLOCK, num_warps=8)
    return out
