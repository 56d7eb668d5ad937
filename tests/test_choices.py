"""``n`` choices, prompt lists and ``echo`` (gateway/choices.py): the fan-out into child
requests, the merged body and stream, all-or-nothing admission, limits.

Most tests run the real gateway against a real Redis and the in-test worker of
gateway_harness.py, which answers each child with a text naming its prompt and seed
(so a choice's text says which child produced it); the ``smollm_stack`` tests run the real
model behind ``inferq gateway`` + ``inferq worker`` and use the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import redis.asyncio as aioredis

from gateway.choices import child_params
from gateway.logprobs import LogprobsFormatter, TokenTexts
from shared import protocol
from shared.protocol import ErrorMessage, GenerateRequest, TokenBatch, TokenLogprobs, TokenOutput
from shared.sampling import SamplingParams
from shared.settings import GatewaySettings
from tests.gateway_harness import MODEL, FakeWorker, sse_events

pytestmark = pytest.mark.timeout(120)


def tag(prompt: str, seed: int | None) -> str:
    """What ``tagged`` answers to ``prompt`` sampled with ``seed``."""
    return f" [{prompt}|{seed}]"


def tagged(delay_s: float = 0.0):
    """A worker behaviour: answer ``tag(prompt, seed)`` one token per message (``delay_s``
    apart, in a task, so children interleave), then EOS."""
    async def behave(req: GenerateRequest, w: FakeWorker) -> None:
        async def run() -> None:
            prompt = w.tok.decode(req.prompt_token_ids, skip_special_tokens=True)
            ids = w.tok.encode(tag(prompt, req.sampling.seed), add_special_tokens=False)
            for i, t in enumerate(ids):
                await w.send(req, i, [t])
                await asyncio.sleep(delay_s)
            await w.send(req, len(ids), [w.tok.eos_token_id], "stop")
        w._tasks.append(asyncio.create_task(run()))
    return behave


def client(harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.base_url + "/v1", api_key="none", max_retries=0)


def num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


async def stream_length(harness) -> int:
    r = aioredis.from_url(harness.redis.url)
    try:
        return await r.xlen(harness.keys.requests_stream(MODEL))
    finally:
        await r.aclose()


# -- fan-out and merge --------------------------------------------------------------------------

async def test_prompt_list_with_n_non_streaming(harness, tokenizer):
    """2 prompts x n=2: four children, choice index = prompt * n + choice, seed + choice."""
    harness.worker.behavior = tagged()
    prompts = ["Alpha beta", "Gamma"]
    async with client(harness) as c:
        resp = await c.completions.create(model=MODEL, prompt=prompts, n=2, seed=5, max_tokens=30)
    assert [ch.index for ch in resp.choices] == [0, 1, 2, 3]
    want = [tag(prompts[k // 2], 5 + k % 2) for k in range(4)]
    assert [ch.text for ch in resp.choices] == want
    assert all(ch.finish_reason == "stop" for ch in resp.choices)
    num_prompt = sum(len(tokenizer(p)["input_ids"]) for p in prompts)  # once per prompt, not per choice
    num_completion = sum(num_tokens(tokenizer, t) + 1 for t in want)  # + EOS each
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (num_prompt, num_completion)
    reqs = sorted(harness.worker.requests, key=lambda r: r.request_id)
    assert [r.request_id for r in reqs] == [f"{resp.id}-{k}" for k in range(4)]
    assert [r.sampling.seed for r in reqs] == [5, 6, 5, 6]
    assert harness.app.state.inferq.relay.num_in_flight == 0


async def test_token_id_prompts_and_single_forms(harness, tokenizer):
    harness.worker.behavior = tagged()
    ids = [tokenizer.encode("one two", add_special_tokens=False), tokenizer.encode("three", add_special_tokens=False)]
    async with client(harness) as c:
        listed = await c.completions.create(model=MODEL, prompt=ids, max_tokens=30)
        single = await c.completions.create(model=MODEL, prompt=ids[1], max_tokens=30)
    assert [ch.text for ch in listed.choices] == [tag("one two", None), tag("three", None)]
    assert [ch.text for ch in single.choices] == [tag("three", None)]
    assert harness.worker.requests[-1].request_id == single.id  # one child keeps the request's id


async def test_chat_n_streaming_indexes_roles_finish(harness):
    """n=3 chat stream: children interleave; each chunk names its choice; each choice gets
    its role chunk and its own finish_reason chunk; one usage chunk at the end."""
    harness.worker.behavior = tagged(delay_s=0.01)
    async with client(harness) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                                 seed=10, stream=True, stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
    texts, roles, finishes, order = {}, {}, {}, []
    for ch in chunks[:-1]:
        assert len(ch.choices) == 1
        choice = ch.choices[0]
        assert choice.index not in finishes, "a chunk after its choice's finish_reason"
        order.append(choice.index)
        if choice.delta.role:
            roles[choice.index] = roles.get(choice.index, 0) + 1
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert roles == {0: 1, 1: 1, 2: 1} and finishes == {0: "stop", 1: "stop", 2: "stop"}
    prompt = harness.worker.tok.decode(harness.worker.requests[0].prompt_token_ids, skip_special_tokens=True)
    assert texts == {k: tag(prompt, 10 + k) for k in range(3)}
    assert order != sorted(order), "the children's chunks should interleave"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(
        num_tokens(harness.worker.tok, t) + 1 for t in texts.values())


async def test_client_request_id_with_children(harness):
    """Children of a client id get ``<id>#<random>-<k>``; the id stays reserved until the last
    child ends, then is free at once."""
    harness.worker.behavior = tagged()
    headers = {"X-Request-Id": "job-7"}
    for _ in range(2):  # the second request reuses the id: it was released
        r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2},
                                    headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "cmpl-job-7" and r.headers["x-request-id"] == "cmpl-job-7"
        for _ in range(100):  # the release runs in a background task after the response
            if not await harness.app.state.inferq.redis.exists(harness.keys.request_id_key(MODEL, "anonymous", "cmpl-job-7")):
                break
            await asyncio.sleep(0.02)
    ids = [q.request_id for q in harness.worker.requests]
    assert len(ids) == 4 and all(i.startswith("cmpl-job-7#") for i in ids)
    assert sorted(i[-2:] for i in ids) == ["-0", "-0", "-1", "-1"]


async def test_tool_calls_and_logprobs_per_choice(harness):
    """Each choice parses its own tool calls and formats its own logprobs."""
    from tests.test_tools import CALL_PARIS, CALL_UTC, TOOLS

    harness.app.state.inferq.max_model_len = 2048  # the tools' system prompt is about 300 tokens

    async def calls(req: GenerateRequest, w: FakeWorker) -> None:
        text = CALL_PARIS if req.sampling.seed % 2 == 0 else CALL_UTC
        ids = [*w.tok.encode(text, add_special_tokens=False), w.tok.eos_token_id]
        for i in range(0, len(ids), 3):
            await w.send(req, i, ids[i:i + 3], "stop" if i + 3 >= len(ids) else None)
    harness.worker.behavior = calls
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Weather and time?"}], "tools": TOOLS, "n": 2,
          "seed": 4, "max_tokens": 100}
    async with client(harness) as c:
        whole = await c.chat.completions.create(**kw)
        streamed: dict[int, list[str]] = {0: [], 1: []}
        finishes = {}
        async for chunk in await c.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                streamed[ch.index] += [t.function.name for t in ch.delta.tool_calls or [] if t.function.name]
                if ch.finish_reason:
                    finishes[ch.index] = ch.finish_reason
    assert [[t.function.name for t in ch.message.tool_calls] for ch in whole.choices] == [["get_weather"],
                                                                                         ["get_time"]]
    assert [ch.finish_reason for ch in whole.choices] == ["tool_calls", "tool_calls"]
    assert streamed == {0: ["get_weather"], 1: ["get_time"]} and finishes == {0: "tool_calls", 1: "tool_calls"}

    harness.worker.behavior = answer_with_prompt_logprobs
    async with client(harness) as c:
        resp = await c.completions.create(model=MODEL, prompt=["a", "b"], logprobs=1, max_tokens=5)
    for ch in resp.choices:  # each choice's text_offset starts at its own text's start
        assert ch.logprobs.text_offset[0] == 0 and ch.logprobs.token_logprobs[0] == -0.5 * 101


# -- errors, disconnects, admission ------------------------------------------------------------

async def test_error_in_one_child_ends_the_stream_and_aborts_the_others(harness):
    async def behave(req: GenerateRequest, w: FakeWorker) -> None:
        async def run() -> None:
            ids = w.tok.encode(" word", add_special_tokens=False)
            await w.send(req, 0, ids)
            if req.request_id.endswith("-1"):
                await asyncio.sleep(0.2)
                await w.client.publish(req.reply_channel, protocol.encode(ErrorMessage(
                    request_id=req.request_id, attempt=0, worker_id="w1", status=500, message="engine broke")))
                return
            for i in range(1, 200):  # the siblings would run on
                await asyncio.sleep(0.02)
                await w.send(req, i, ids)
        w._tasks.append(asyncio.create_task(run()))
    harness.worker.behavior = behave
    harness.worker.ack = False
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 3, "stream": True,
                                                         "max_tokens": 200})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == "engine broke"
    assert all("error" not in json.loads(e) for e in events[:-2])
    for child in ("-0", "-2"):
        await harness.worker.wait_for_abort(r.headers["x-request-id"] + child)
    assert harness.app.state.inferq.relay.num_in_flight == 0
    # Not streaming: the same error as a status.
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 3, "max_tokens": 200})
    assert r.status_code == 500 and r.json()["error"]["message"] == "engine broke"
    for req in harness.worker.requests[3:]:
        if not req.request_id.endswith("-1"):
            await harness.worker.wait_for_abort(req.request_id)


async def test_client_disconnect_closes_every_child(harness):
    async def endless(req: GenerateRequest, w: FakeWorker) -> None:
        async def run() -> None:
            ids = w.tok.encode(" word", add_special_tokens=False)
            for i in range(200):
                await w.send(req, i, ids)
                await asyncio.sleep(0.02)
        w._tasks.append(asyncio.create_task(run()))
    harness.worker.behavior = endless
    harness.worker.ack = False
    async with harness.http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "x", "n": 3, "stream": True, "max_tokens": 200}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                request_id = json.loads(line[6:])["id"]
                break
    for k in range(3):
        abort = await harness.worker.wait_for_abort(f"{request_id}-{k}", timeout_s=10)
        assert abort.reason == "client disconnected"
    assert harness.app.state.inferq.relay.num_in_flight == 0


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(max_queue_len=2)])
async def test_queue_depth_counts_the_children(harness):
    await harness.worker.stop()  # nobody consumes: the queue depth is what is XADDed
    before = await stream_length(harness)
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 3})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    assert await stream_length(harness) == before
    harness.worker = FakeWorker(harness.redis.url, harness.keys, MODEL, harness.worker.tok)
    await harness.worker.start()
    harness.worker.behavior = tagged()
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


@pytest.mark.parametrize("headers", [{}, {"X-Request-Id": "oom-1"}])
async def test_failed_enqueue_leaves_nothing(harness, headers):
    """Redis refuses the write (out of memory): 503, no entry on the stream, nothing
    registered, the client id not taken (both enqueue paths: MULTI/EXEC and the Lua script)."""
    admin = aioredis.from_url(harness.redis.url)
    before = await stream_length(harness)
    await admin.config_set("maxmemory-policy", "noeviction")
    await admin.config_set("maxmemory", "1")
    try:
        r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 3},
                                    headers=headers)
    finally:
        await admin.config_set("maxmemory", "0")
    try:
        assert r.status_code == 503 and r.json()["error"]["code"] == "redis_unavailable", r.text
        assert await stream_length(harness) == before
        assert harness.app.state.inferq.relay.num_in_flight == 0 and harness.worker.requests == []
        assert not await admin.exists(harness.keys.request_id_key(MODEL, "anonymous", "cmpl-oom-1"))
    finally:
        await admin.aclose()


async def test_duplicate_client_id_enqueues_no_child(harness):
    async def silent(req, w):
        return None
    harness.worker.behavior = silent
    harness.worker.ack = False
    first = asyncio.create_task(harness.http.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "n": 2}, headers={"X-Request-Id": "dup"}))
    while len(harness.worker.requests) < 2:
        await asyncio.sleep(0.02)
    before = await stream_length(harness)
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 3},
                                headers={"X-Request-Id": "dup"})
    assert r.status_code == 409, r.text
    assert await stream_length(harness) == before and harness.app.state.inferq.relay.num_in_flight == 2
    first.cancel()


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": ["x"] * 33}, "prompt"),
    ({"prompt": ["x"] * 5, "n": 13}, "n"),
    ({"prompt": "x", "n": 2, "seed": 2**63 - 1}, "seed"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # scoring the prompt only needs echo
    ({"prompt": "x", "max_tokens": 0, "echo": True, "extra_body": {"min_tokens": 1}}, "min_tokens"),
])
async def test_limits_are_400_naming_the_param(harness, body, param):
    async with client(harness) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.completions.create(model=MODEL, **body)
    assert info.value.body["param"] == param
    assert harness.worker.requests == []


# -- echo ----------------------------------------------------------------------------------------

def fake_logprobs(index: int, token_id: int, num_top: int) -> TokenLogprobs:
    return TokenLogprobs(-0.5 * (index + 1), [(token_id + j, -0.5 * (index + 1) - j) for j in range(num_top)])


async def answer_with_prompt_logprobs(req: GenerateRequest, w: FakeWorker) -> None:
    """" done" then EOS in one message (cut to ``max_tokens``, then ending with "length");
    logprobs and prompt logprobs as asked (what a worker sends: ``prompt_logprobs`` on the
    first entry, scoring prompt tokens 1..)."""
    answer = [*w.tok.encode(" done", add_special_tokens=False), w.tok.eos_token_id]
    ids = answer[:req.sampling.max_tokens]
    k = req.sampling.logprobs
    prompt_k = req.sampling.prompt_logprobs
    out = TokenOutput(
        request_id=req.request_id, attempt=req.attempt, first_index=0, token_ids=ids,
        finish_reason="stop" if ids == answer else "length",
        num_prompt_tokens=len(req.prompt_token_ids),
        logprobs=None if k is None else [fake_logprobs(100 + i, t, k) for i, t in enumerate(ids)],
        prompt_logprobs=None if prompt_k is None else [fake_logprobs(i, t, prompt_k)
                                                        for i, t in enumerate(req.prompt_token_ids[1:])])
    await w.client.publish(req.reply_channel, protocol.encode(TokenBatch(worker_id="w1", outputs=[out])))


async def test_echo_text_streaming_and_not(harness, tokenizer):
    """Each choice's text starts with its prompt's: as given, or a token-id prompt decoded;
    in a stream, as its first content."""
    harness.worker.behavior = tagged()
    prompts = ["Hello there", "Tokens here"]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    async with client(harness) as c:
        resp = await c.completions.create(model=MODEL, prompt=prompts, n=2, echo=True, max_tokens=30)
        stream = await c.completions.create(model=MODEL, prompt=ids, n=2, echo=True, max_tokens=30, stream=True)
        chunks = [ch async for ch in stream]
    assert [ch.text for ch in resp.choices] == [prompts[k // 2] + tag(prompts[k // 2], None) for k in range(4)]
    texts: dict[int, list[str]] = {}
    for ch in chunks:
        texts.setdefault(ch.choices[0].index, []).append(ch.choices[0].text)
    assert all(texts[k][0].startswith(prompts[k // 2]) for k in range(4)), texts
    assert {k: "".join(t) for k, t in texts.items()} == {k: prompts[k // 2] + tag(prompts[k // 2], None)
                                                          for k in range(4)}
    assert all(r.sampling.prompt_logprobs is None for r in harness.worker.requests)


async def test_echo_with_logprobs_puts_the_prompt_first(harness, tokenizer):
    harness.worker.behavior = answer_with_prompt_logprobs
    prompt = "The sky is"
    prompt_ids = tokenizer(prompt)["input_ids"]
    texts = TokenTexts(tokenizer)
    prompt_tokens = [texts.get(t)[0] for t in prompt_ids]
    done_id = tokenizer.encode(" done", add_special_tokens=False)[0]
    async with client(harness) as c:
        resp = await c.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=5)
        stream = await c.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=5,
                                            stream=True)
        first = next(iter([ch async for ch in stream])).choices[0]
    assert harness.worker.requests[0].sampling.prompt_logprobs == 2
    for choice in (resp.choices[0], first):
        lp = choice.logprobs
        assert choice.text.startswith(prompt)
        num = len(prompt_ids)
        assert lp.tokens[:num] == prompt_tokens and lp.tokens[num] == texts.get(done_id)[0]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:num] == [-0.5 * (i + 1) for i in range(num - 1)]
        assert lp.token_logprobs[num] == -0.5 * 101
        assert lp.text_offset[0] == 0 and lp.text_offset[num] == sum(len(t) for t in prompt_tokens)
        assert len(lp.top_logprobs[1]) == 2


async def test_echo_max_tokens_0_scores_the_prompt_only(harness, tokenizer):
    """``echo`` + ``max_tokens: 0``: the worker runs one step (``max_tokens`` 1) for the
    prompt's logprobs; each choice is the prompt alone: its text and logprobs, no output
    token, ``completion_tokens`` 0, finish_reason "length"; streaming likewise."""
    harness.worker.behavior = answer_with_prompt_logprobs
    prompt = "The sky is"
    prompt_ids = tokenizer(prompt)["input_ids"]
    prompt_tokens = [TokenTexts(tokenizer).get(t)[0] for t in prompt_ids]
    kw = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0}
    async with client(harness) as c:
        resp = await c.completions.create(logprobs=1, **kw)
        stream = await c.completions.create(logprobs=1, stream=True, stream_options={"include_usage": True}, **kw)
        chunks = [ch async for ch in stream]
        listed = await c.completions.create(**{**kw, "prompt": [prompt, "Hi"]}, n=2)
    assert [(r.sampling.max_tokens, r.sampling.prompt_logprobs) for r in harness.worker.requests[:2]] == [(1, 1)] * 2
    choice = resp.choices[0]
    assert (choice.text, choice.finish_reason) == (prompt, "length")
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt_ids), 0)
    lp = choice.logprobs
    assert lp.tokens == prompt_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [-0.5 * (i + 1) for i in range(len(prompt_ids) - 1)]
    *parts, last = chunks
    assert "".join(ch.choices[0].text for ch in parts) == prompt
    assert [ch.choices[0].finish_reason for ch in parts] == [None] * (len(parts) - 1) + ["length"]
    assert [t for ch in parts if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens] == prompt_tokens
    assert (last.choices, last.usage.completion_tokens) == ([], 0)
    assert [(ch.text, ch.finish_reason) for ch in listed.choices] == [(p, "length") for p in [prompt] * 2 + ["Hi"] * 2]
    assert all(ch.logprobs is None for ch in listed.choices) and listed.usage.completion_tokens == 0


def test_prompt_logprobs_formatting(tokenizer):
    ids = tokenizer.encode("a b c", add_special_tokens=False)
    fmt = LogprobsFormatter(tokenizer, 1, chat=False)
    prompt = fmt.format_prompt(ids, [fake_logprobs(i, t, 1) for i, t in enumerate(ids[1:])])
    out = fmt.format([ids[0]], [TokenLogprobs(-1.0, [])])
    texts = [TokenTexts(tokenizer).get(t)[0] for t in ids]
    assert prompt["tokens"] == texts and prompt["token_logprobs"] == [None, -0.5, -1.0]
    assert prompt["top_logprobs"][0] is None and prompt["top_logprobs"][1] == {texts[1]: -0.5}
    assert prompt["text_offset"] == [0, len(texts[0]), len(texts[0]) + len(texts[1])]
    assert out["text_offset"] == [sum(len(t) for t in texts)]  # the output counts on from the prompt's end
    with pytest.raises(ValueError):
        fmt.format_prompt(ids, [])


def test_child_params_offsets_the_seed():
    seeded = SamplingParams(seed=40, temperature=1.0)
    assert [child_params(seeded, j).seed for j in range(3)] == [40, 41, 42]
    assert child_params(SamplingParams(), 2).seed is None


# -- the real model ------------------------------------------------------------------------------

def test_real_model_n_seeded_choices(smollm_stack):
    """n=3 sampled with a seed: three choices, not all alike, the same on a second call;
    usage counts the prompt once and every choice's tokens; greedy choices are equal."""
    with openai.OpenAI(base_url=smollm_stack + "/v1", api_key="none", max_retries=0) as c:
        kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 123,
              "extra_body": {"ignore_eos": True}}
        one = c.completions.create(**kw)
        a = c.completions.create(n=3, **kw)
        b = c.completions.create(n=3, **kw)
        greedy = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, n=2)
    texts = [ch.text for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert len(set(texts)) > 1 and texts == [ch.text for ch in b.choices]
    assert texts[0] == one.choices[0].text  # choice 0 samples with the seed itself
    assert a.usage.prompt_tokens == one.usage.prompt_tokens and a.usage.completion_tokens == 3 * 8
    assert greedy.choices[0].text == greedy.choices[1].text


def test_real_model_streaming_chat_n(smollm_stack):
    messages = [{"role": "user", "content": "Name a colour."}]
    with openai.OpenAI(base_url=smollm_stack + "/v1", api_key="none", max_retries=0) as c:
        kw = {"model": MODEL, "messages": messages, "n": 2, "max_tokens": 10, "temperature": 1.0, "seed": 7}
        whole = c.chat.completions.create(**kw)
        texts, finishes = {0: "", 1: ""}, {}
        for chunk in c.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
                if ch.finish_reason:
                    finishes[ch.index] = ch.finish_reason
        echoed = c.completions.create(model=MODEL, prompt="Paris is", echo=True, max_tokens=4, temperature=0)
    assert texts == {ch.index: ch.message.content for ch in whole.choices}
    assert set(finishes) == {0, 1}
    assert echoed.choices[0].text.startswith("Paris is") and len(echoed.choices[0].text) > len("Paris is")


def test_real_model_echo_prompt_logprobs(smollm_stack, smollm_tokenizer):
    """``echo`` + ``logprobs`` on the real engine: the prompt's tokens come first, the first
    unscored; a prompt token's logprob equals the logprob the same token got as output."""
    tok = smollm_tokenizer
    prompt_ids = tok.encode("The capital of France is", add_special_tokens=False)
    with openai.OpenAI(base_url=smollm_stack + "/v1", api_key="none", max_retries=0) as c:
        gen = c.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=2, temperature=0, logprobs=1)
        out_ids = [tok.encode(t, add_special_tokens=False) for t in gen.choices[0].logprobs.tokens]
        assert all(len(i) == 1 for i in out_ids), out_ids
        ids = prompt_ids + [i[0] for i in out_ids]
        kw = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        whole = c.completions.create(**kw)
        first = next(iter(c.completions.create(stream=True, **kw))).choices[0]
    texts = [TokenTexts(tok).get(t)[0] for t in ids]
    for choice in (whole.choices[0], first):
        lp = choice.logprobs
        assert choice.text.startswith(tok.decode(ids))
        assert lp.tokens[:len(ids)] == texts and lp.text_offset[:2] == [0, len(texts[0])]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:len(ids)])
        assert all(texts[i] in lp.top_logprobs[i] for i in range(1, len(ids)))
        # the two tokens generated above, now scored as prompt tokens
        assert lp.token_logprobs[len(prompt_ids):len(ids)] == pytest.approx(gen.choices[0].logprobs.token_logprobs,
                                                                            abs=2e-3)
