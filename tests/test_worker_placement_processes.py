"""The worker's side of placement with real worker processes (sim backend): a worker
SIGKILLed with requests running and more waiting in its own placed stream (every one
completes on the other worker, token for token), and a worker that refuses to start
beside a live worker of another block size."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared import protocol
from shared.embedded_redis import EmbeddedRedis
from shared.fair_queue import DEFAULT_CLASS, PRIORITY_CLASSES
from shared.keys import CONSUMER_GROUP, Keys
from shared.protocol import ErrorMessage, GenerateRequest, TokenBatch, WorkerStatus
from shared.sampling import SamplingParams
from tests import processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "SmolLM2-135M-Instruct"
KEYS = Keys()
SIM = ("--backend", "sim", "--sim-step-time-ms", "20")


@pytest.fixture
def server(smollm_source) -> Iterator[EmbeddedRedis]:
    s = EmbeddedRedis().start()
    try:
        yield s
    finally:
        s.close()


def _enqueue_placed(url: str, worker_id: str, requests: list[GenerateRequest]) -> None:
    """Place ``requests`` on ``worker_id``'s stream as a gateway does (the enqueue script)."""
    import asyncio

    import redis.asyncio as aioredis

    from shared.fair_queue import FairQueue, Placement

    async def put() -> None:
        client = aioredis.from_url(url)
        try:
            queue = FairQueue(client, KEYS, MODEL)
            for r in requests:
                ids = await queue.enqueue(queue.stream(DEFAULT_CLASS, "t"), [r],
                                          placement=Placement(worker_id, len(r.prompt_token_ids)))
                assert ids
        finally:
            await client.aclose()

    asyncio.run(put())


def test_a_killed_workers_running_and_placed_requests_complete_on_another(server: EmbeddedRedis,
                                                                          tmp_path: Path) -> None:
    """wa (2 slots) runs 2 of 6 requests placed on it, 4 wait in its stream; SIGKILL. wb,
    which never takes from a live worker (``--steal-after-ms 0``), takes the 4 once wa's
    heartbeat is gone and claims the 2 pending ones from the dead consumer: each request
    ends with the sim's echo at every index, and an index delivered twice (the claimed
    run starts over; a gateway drops the repeat) carries the same token."""
    wa = processes.start("worker", server.url, "--worker-id", "wa", *SIM, "--max-num-seqs", "2",
                         log_path=tmp_path / "wa.log")
    wb = processes.start("worker", server.url, "--worker-id", "wb", *SIM, "--max-num-seqs", "8",
                         "--steal-after-ms", "0", log_path=tmp_path / "wb.log")
    client = redis.from_url(server.url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        processes.wait_for_workers(server.url, 2, [wa, wb])
        channel = KEYS.gateway_channel("g")
        pubsub.subscribe(channel)
        max_tokens = 60
        requests = [GenerateRequest(request_id=f"r{i}", model=MODEL, prompt_token_ids=[100 + i, 200 + i, 300 + i],
                                    sampling=SamplingParams(max_tokens=max_tokens), reply_channel=channel,
                                    deadline_unix_s=time.time() + 240) for i in range(6)]
        _enqueue_placed(server.url, "wa", requests)
        tokens: dict[str, dict[int, set[int]]] = {r.request_id: {} for r in requests}
        finished: set[str] = set()
        workers: dict[str, set[str]] = {r.request_id: set() for r in requests}

        def read(until) -> None:  # type: ignore[no-untyped-def]
            deadline_s = time.monotonic() + 120
            while not until():
                assert time.monotonic() < deadline_s, (sorted(finished), {k: len(v) for k, v in tokens.items()})
                item = pubsub.get_message(timeout=0.2)
                if item is None:
                    continue
                message = protocol.decode(item["data"])
                assert not isinstance(message, ErrorMessage), message
                assert isinstance(message, TokenBatch)
                for out in message.outputs:
                    workers[out.request_id].add(message.worker_id)
                    for k, t in enumerate(out.token_ids):
                        tokens[out.request_id].setdefault(out.first_index + k, set()).add(t)
                    if out.finish_reason is not None:
                        finished.add(out.request_id)

        read(lambda: sum(len(v) >= 5 for v in tokens.values()) == 2)  # wa is mid-generation
        placed = KEYS.placed_stream(MODEL, "wa", DEFAULT_CLASS)
        assert client.xlen(placed) == 6 and client.xpending(placed, CONSUMER_GROUP)["pending"] == 2
        wa.send_signal(signal.SIGKILL)
        wa.wait(10)
        read(lambda: len(finished) == len(requests))
        for r in requests:
            p = r.prompt_token_ids
            assert tokens[r.request_id] == {i: {p[i % 3]} for i in range(max_tokens)}, r.request_id
        assert sum("wa" in w for w in workers.values()) == 2 and all("wb" in w for w in workers.values())
        # Nothing stays pending, and wa's placed streams go (the reaper's cleanup).
        deadline_s = time.monotonic() + 30
        wa_streams = [KEYS.placed_stream(MODEL, "wa", c) for c in PRIORITY_CLASSES]
        while client.exists(*wa_streams) or client.hget(KEYS.placed_tokens(MODEL), "wa") is not None:
            assert time.monotonic() < deadline_s, "wa's placed streams were not cleaned up"
            time.sleep(0.2)
        assert wb.poll() is None
    finally:
        pubsub.close()
        client.close()
        for proc in (wa, wb):
            processes.stop(proc, signal.SIGKILL)


def test_a_worker_refuses_to_start_beside_a_live_worker_of_another_block_size(server: EmbeddedRedis,
                                                                                tmp_path: Path) -> None:
    client = redis.from_url(server.url)
    try:
        status = WorkerStatus(worker_id="other", model=MODEL, backend="sim", num_running=0, num_waiting=0,
                              kv_usage=0.0, num_free_blocks=8, block_size=32, max_num_seqs=4,
                              updated_unix_s=time.time(), started_unix_s=time.time(), pid=1)
        client.set(KEYS.worker_key("other"), protocol.encode(status), ex=120)
        proc = processes.start("worker", server.url, "--worker-id", "w16", *SIM, log_path=tmp_path / "w16.log")
        try:
            code = proc.wait(120)
        finally:
            processes.stop(proc, signal.SIGKILL)
        log = (tmp_path / "w16.log").read_text()
        assert code != 0, log
        assert "Traceback" not in log, log
        last = log.strip().splitlines()[-1]
        assert last.startswith("inferq worker: worker other") and "block size 32" in last and "16" in last, log
        assert client.get(KEYS.worker_key("w16")) is None  # it never announced itself
    finally:
        client.close()
