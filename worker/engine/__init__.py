"""The in-house engine: request state, block manager, scheduler, model runner, sampler.

Ownership runs one way: ``LLMEngine`` owns the ``Scheduler`` and the ``ModelRunner``;
the scheduler owns the ``BlockManager``; the model runner never sees the scheduler.
"""
