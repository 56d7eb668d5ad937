"""The slice's openai-client end-to-end tests with ``inferq worker --backend vllm``: the
official openai client -> gateway process -> Redis stream -> worker process running vLLM's
engine in-process -> pub/sub -> SSE. Answers and usage must equal our engine's offline
greedy run (SmolLM2 float32 on CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import processes
from tests.test_serving_e2e import (  # noqa: F401 - pytest collects these here, with this stack
    test_chat_answer_names_paris_and_usage_matches,
    test_chat_stream_matches_non_stream,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
#: This module's key in tests/conftest.py's ``_EARLY_STACKS``.
MODULE = __name__.replace(".", "/") + ".py"


@pytest.fixture(scope="module")
def redis_url(early_stack) -> str:
    return early_stack(MODULE)[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_source, early_stack) -> Iterator[str]:
    """A gateway and one vLLM-backed worker (eager, 128 MiB KV cache; started when
    collection ended: tests/conftest.py, ``early_stack``); yields the URL."""
    redis_url, worker, _ = early_stack(MODULE)
    logs = tmp_path_factory.mktemp("logs")
    port = processes.free_port()
    gateway = processes.start("gateway", redis_url, "--port", str(port), log_path=logs / "gateway.log")
    try:
        url = f"http://127.0.0.1:{port}"
        processes.wait_for_gateway(url, gateway)
        processes.wait_for_workers(redis_url, 1, [worker], timeout_s=300)
        yield url
    finally:
        processes.stop(gateway)


def test_heartbeat_carries_vllms_load(stack, redis_url) -> None:
    """The worker's heartbeat names the backend and reports vLLM's KV cache, idle again
    once earlier tests' requests are done (heartbeats come every HEARTBEAT_INTERVAL_S)."""
    import time

    import redis

    from shared import protocol
    from shared.keys import HEARTBEAT_INTERVAL_S, Keys

    client = redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 5 * HEARTBEAT_INTERVAL_S
        while True:
            status = protocol.decode(client.get(Keys("inferq").worker_key("vllm-1")))
            assert isinstance(status, protocol.WorkerStatus)
            idle = (status.num_running, status.num_waiting) == (0, 0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        client.close()
    assert status.backend == "vllm" and status.block_size == 128 and status.max_num_seqs == 16
    assert (status.num_running, status.num_waiting, status.kv_usage) == (0, 0, 0.0) and status.num_free_blocks > 0
