"""Kernels over the paged KV cache: a PyTorch reference for each (runs on CPU and
CUDA, and is the oracle in tests) and a Triton implementation for CUDA.

Cache layout (per layer): ``k_cache`` and ``v_cache`` are each
``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot ``s`` lives at block
``s // block_size``, offset ``s % block_size``.
"""


def triton_available() -> bool:
    """True when Triton imports and a CUDA device is present."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
