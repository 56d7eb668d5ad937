"""Redis URLs (``shared/redis_url.py``) and what ``shared/redis_connect.py`` makes of them,
against real servers where a connection is involved."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.exceptions

from shared.keys import Keys
from shared.redis_connect import NotSentError, SentinelRedis, connect, retry_unsent
from shared.redis_url import parse_redis_url
from shared.settings import RedisSettings, SettingsError
from tests.processes import free_port


def test_sentinel_url_names_sentinels_service_db_and_both_passwords() -> None:
    t = parse_redis_url("redis+sentinel://app:s%40cret@h1:26380,h2,[::1]:5/mymaster/3?sentinel_password=sp")
    assert (t.kind, t.nodes, t.service_name, t.db) == ("sentinel", (("h1", 26380), ("h2", 26379), ("::1", 5)),
                                                       "mymaster", 3)
    assert (t.username, t.password, t.sentinel_password, t.ssl) == ("app", "s@cret", "sp", False)
    assert parse_redis_url("rediss+sentinel://h/m").ssl and parse_redis_url("rediss+sentinel://h/m").db == 0
    assert "s@cret" not in repr(t) and "sp" not in repr(t)


def test_cluster_and_server_urls() -> None:
    t = parse_redis_url("redis+cluster://:pw@n1:7000,n2")
    assert (t.kind, t.nodes, t.password) == ("cluster", (("n1", 7000), ("n2", 6379)), "pw")
    for url in ("redis://h:6379/0", "rediss://h", "unix:///tmp/r.sock?db=2"):
        assert parse_redis_url(url).kind == "server"


@pytest.mark.parametrize("url,reason", [
    ("redis+sentinel://h1,h2", "name the primary's service"),
    ("redis+sentinel://h1/m/x", "must be a number"),
    ("redis+sentinel://h1/m/0?password=x", "unknown parameter"),
    ("redis+cluster://n1/2", "database 0 only"),
    ("redis+cluster://n1:0", "bad port"),
    ("redis+cluster://", "names no host"),
    ("http://h", "the scheme must be one of"),
])
def test_bad_urls_say_why(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_redis_url(url)


def test_a_bad_url_is_a_settings_error_without_its_password() -> None:
    with pytest.raises(SettingsError) as info:
        RedisSettings(redis_url="redis+sentinel://u:hunter2@h1")
    assert "--redis-url" in str(info.value) and "hunter2" not in str(info.value) and "u:***@" in str(info.value)
    with pytest.raises(SettingsError, match="--namespace"):
        RedisSettings(namespace="a{b}")


def test_every_key_of_a_model_carries_its_hash_tag() -> None:
    from redis.crc import key_slot

    k, model = Keys("ns"), "Qwen/Qwen2.5-7B"
    names = [k.requests_stream(model), k.class_stream(model, "interactive", "t1"), k.model_streams(model),
             k.active_streams(model, "batch"), k.doorbell(model), k.placed_stream(model, "w1", "default"),
             k.worker_doorbell(model, "w1"), k.placed_tokens(model), k.placed_requests(model), k.worker_load(model),
             k.worker_held(model), k.kv_index(model, "w1"),
             k.rate_limit_key(model, "t1"), k.request_id_key(model, "t1", "req-1"), k.arrivals_channel(model)]
    assert all(n.startswith("ns:{Qwen/Qwen2.5-7B}:") for n in names)
    assert {key_slot(n.encode()) for n in names} == {key_slot(model.encode())}


async def test_a_refused_connection_is_not_sent_and_retried_until_the_budget(redis_server) -> None:
    client = connect(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    calls = 0

    async def ping() -> bool:
        nonlocal calls
        calls += 1
        return bool(await client.ping())

    try:
        start = time.monotonic()
        with pytest.raises(NotSentError):
            await retry_unsent(ping, 0.5)
        assert calls >= 3 and time.monotonic() - start < 5
    finally:
        await client.aclose()
    # A served URL answers at once; a command error is not retried.
    served = connect(redis_server.url)
    try:
        assert await retry_unsent(served.ping, 1.0)
        with pytest.raises(redis.exceptions.ResponseError):
            await retry_unsent(lambda: served.execute_command("NO-SUCH-COMMAND"), 1.0)
    finally:
        await served.aclose()


async def test_a_sentinel_that_does_not_answer_is_not_sent() -> None:
    client = connect(f"redis+sentinel://127.0.0.1:{free_port()}/mymaster/0")
    assert isinstance(client, SentinelRedis)
    try:
        with pytest.raises(NotSentError, match="No master found"):
            await asyncio.wait_for(client.set("k", 1), 10)
    finally:
        await client.aclose()
