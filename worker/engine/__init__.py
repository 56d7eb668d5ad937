"""The in-house engine: request state, block manager, scheduler, model runner, sampler.

Ownership runs one way: ``LLMEngine`` owns the ``Scheduler`` and the ``ModelRunner`` and
talks only to them; the scheduler owns the ``BlockManager`` (the engine builds it, hands
it over and keeps no reference: admission counts, the async decode step's blocks and KV
statistics are the scheduler's); the model runner never sees the scheduler. The types the
engine returns to the worker live in ``worker/backends/base.py``.
"""
