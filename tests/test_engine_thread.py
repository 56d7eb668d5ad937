"""The worker's engine thread: every call on one thread, not the event loop's."""

from __future__ import annotations

import asyncio
import threading

import pytest

from worker.engine_thread import EngineThread


def test_engine_thread_runs_every_call_on_one_thread_and_raises_errors() -> None:
    async def main() -> tuple[set[int], int]:
        engine_thread = EngineThread()
        try:
            # Other blocking work on asyncio's default executor must not move the engine.
            idents = await asyncio.gather(*(engine_thread.run(threading.get_ident) for _ in range(8)),
                                          *(asyncio.to_thread(threading.get_ident) for _ in range(8)))
            with pytest.raises(ZeroDivisionError):
                await engine_thread.run(divmod, 1, 0)
            assert await engine_thread.run(divmod, 7, 2) == (3, 1)
            return set(idents[:8]), threading.get_ident()
        finally:
            engine_thread.close()

    engine_idents, loop_ident = asyncio.run(main())
    assert len(engine_idents) == 1 and loop_ident not in engine_idents
