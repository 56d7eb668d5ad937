"""End-to-end happy paths of the gateway: both endpoints, streaming and not, stop strings,
multi-byte characters, token ordering (fixtures: gateway_harness.py)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from shared import protocol
from shared.protocol import TokenBatch, TokenOutput
from tests.gateway_harness import ANSWER, MODEL, answer_tokens, sse_events

pytestmark = pytest.mark.timeout(60)

# -- happy paths ------------------------------------------------------------------------

async def test_completion_non_streaming(harness, tokenizer):
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France:"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == ANSWER and body["choices"][0]["finish_reason"] == "stop"
    prompt_ids = tokenizer("The capital of France:")["input_ids"]
    n_answer = len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1  # + EOS
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": n_answer,
                             "total_tokens": len(prompt_ids) + n_answer, "prompt_tokens_details": {"cached_tokens": 0}}
    req = harness.worker.requests[-1]
    assert req.request_id == body["id"] and req.attempt == 0 and req.prompt_token_ids == prompt_ids
    assert req.sampling.max_tokens == 16 and req.reply_channel.startswith(f"{harness.keys.namespace}:gateway:")
    assert time.time() < req.deadline_unix_s <= time.time() + 10.5
    assert 'inferq:request_success_total{finished_reason="stop",model_name="SmolLM2-135M-Instruct"} 1.0' \
        in harness.metrics()
    assert "inferq:time_to_first_token_seconds_count" in harness.metrics()


async def test_chat_non_streaming_openai_client(harness, tokenizer):
    import openai

    client = openai.AsyncOpenAI(base_url=harness.base_url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    resp = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0, seed=3,
                                                stop=["never"], extra_body={"top_k": 5})
    await client.close()
    assert resp.choices[0].message.content == ANSWER and resp.choices[0].message.role == "assistant"
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    req = harness.worker.requests[-1]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert req.prompt_token_ids == list(expected)
    assert req.sampling.max_tokens == 256 - len(expected)
    assert req.sampling.temperature == 0 and req.sampling.seed == 3 and req.sampling.top_k == 5
    assert resp.usage.prompt_tokens == len(expected)


async def test_completion_streaming_openai_client_with_usage(harness):
    import openai

    client = openai.AsyncOpenAI(base_url=harness.base_url + "/v1", api_key="none", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=20, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    await client.close()
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ANSWER
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 3
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.total_tokens == 9


async def test_chat_streaming_sse_framing(harness):
    r = await harness.http.post("/v1/chat/completions", headers={"X-Request-Id": "abc-1"}, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"] == "chatcmpl-abc-1"
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-abc-1" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ANSWER
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("stop") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("usage" in c for c in chunks)


async def test_models_health_metrics(harness):
    r = await harness.http.get("/v1/models")
    assert r.json()["data"][0]["id"] == MODEL and r.json()["data"][0]["max_model_len"] == 256
    assert r.json()["object"] == "list"
    r = await harness.http.get("/health")
    assert r.status_code == 200
    r = await harness.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "# TYPE inferq:e2e_request_latency_seconds histogram" in r.text
    assert "# TYPE inferq:requests_rejected_total counter" in r.text


# -- stop strings, multi-byte, ordering ---------------------------------------------------

async def test_stop_string_non_streaming_publishes_abort(harness):
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stop": [" the", "zzz"]})
    body = r.json()
    assert body["choices"][0]["text"] == " Paris is" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3
    abort = await harness.worker.wait_for_abort(body["id"])
    assert abort.reason == "stop string"


async def test_stop_string_streaming_never_leaks_partial_stop(harness):
    async def slow(req, w):
        ids = w.tok.encode(ANSWER, add_special_tokens=False)
        for i, t in enumerate(ids):
            await w.send(req, i, [t])
            await asyncio.sleep(0.02)
    harness.worker.behavior = slow
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True,
                                                         "stop": " the cap", "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == " Paris is"
    assert not any(" the" in t for t in texts)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 4  # " Paris", " is", " the", " capital"
    await harness.worker.wait_for_abort(chunks[0]["id"])


def _split_char_ids(tok) -> tuple[str, list[int]]:
    text = " 你好🎉!"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([i]) == "\ufffd" for i in ids), "need a token that alone decodes to U+FFFD"
    return text, ids


async def test_multibyte_split_across_tokens_streaming(harness):
    text, ids = _split_char_ids(harness.worker.tok)

    async def multibyte(req, w):
        for i, t in enumerate(ids):
            await w.send(req, i, [t])
        await w.send(req, len(ids), [], "length")
    harness.worker.behavior = multibyte
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == text
    assert not any("\ufffd" in t for t in texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_overlapping_messages_are_trimmed(harness):
    async def overlapping(req, w):
        ids = w.tok.encode(ANSWER, add_special_tokens=False)
        await w.send(req, 0, ids[:2])
        await w.send(req, 1, ids[1:4])  # overlaps token 1
        await w.send(req, 2, ids[2:3])  # pure duplicate
        await w.send(req, 4, ids[4:] + [w.tok.eos_token_id], "stop")
    harness.worker.behavior = overlapping
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    body = r.json()
    assert body["choices"][0]["text"] == ANSWER and body["usage"]["completion_tokens"] == 6


async def test_gap_in_token_indices_is_an_error(harness):
    async def gappy(req, w):
        ids = w.tok.encode(ANSWER, add_special_tokens=False)
        await w.send(req, 0, ids[:1])
        await w.send(req, 3, ids[3:], "length")
    harness.worker.behavior = gappy
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "missing_tokens"


async def test_older_attempt_messages_are_dropped(harness):
    async def old_attempt(req, w):
        stale = TokenBatch(worker_id="old", outputs=[TokenOutput(
            request_id=req.request_id, attempt=-1, first_index=0,
            token_ids=[w.tok.encode(" WRONG", add_special_tokens=False)[0]])])
        await w.client.publish(req.reply_channel, protocol.encode(stale))
        await answer_tokens(req, w)
    harness.worker.behavior = old_attempt
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.json()["choices"][0]["text"] == ANSWER
