"""Tensor parallelism: one worker over several GPUs (``--tensor-parallel-size``); see
docs/architecture.md, "Tensor parallelism"."""
