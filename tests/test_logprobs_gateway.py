"""Logprobs through the gateway (fixtures: gateway_harness.py): the OpenAI objects of
both endpoints, streaming and not, read with the official ``openai`` client; token texts
and bytes; the 400s."""

from __future__ import annotations

import openai
import pytest

from gateway.logprobs import TokenTexts
from shared import protocol
from shared.protocol import GenerateRequest, TokenBatch, TokenLogprobs, TokenOutput
from tests.gateway_harness import ANSWER, MODEL, FakeWorker

pytestmark = pytest.mark.timeout(60)


def fake_logprobs(index: int, token_id: int, num_top: int) -> TokenLogprobs:
    """A made-up but well-formed entry: the token and its neighbours most likely, or
    (odd ``index``, as a sampled token can be) only its neighbours."""
    lp = -0.25 * (index + 1)
    skip = index % 2
    return TokenLogprobs(lp, [(token_id + skip + j, lp - j) for j in range(num_top)])


def answer_ids(w: FakeWorker) -> list[int]:
    return [*w.tok.encode(ANSWER, add_special_tokens=False), w.tok.eos_token_id]


async def answer_with_logprobs(req: GenerateRequest, w: FakeWorker) -> None:
    """ANSWER then EOS, two tokens per message, with logprobs when the request asks."""
    ids = answer_ids(w)
    k = req.sampling.logprobs
    for start in range(0, len(ids), 2):
        chunk = ids[start:start + 2]
        lps = None if k is None else [fake_logprobs(start + i, t, k) for i, t in enumerate(chunk)]
        out = TokenOutput(request_id=req.request_id, attempt=req.attempt, first_index=start, token_ids=chunk,
                          finish_reason="stop" if start + 2 >= len(ids) else None,
                          num_prompt_tokens=len(req.prompt_token_ids), logprobs=lps)
        await w.client.publish(req.reply_channel, protocol.encode(TokenBatch(worker_id="w1", outputs=[out])))


def client(harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.base_url + "/v1", api_key="none", max_retries=0)


def check_chat_content(content, tokenizer, ids: list[int], num_top: int) -> None:
    assert len(content) == len(ids)
    for i, (entry, token_id) in enumerate(zip(content, ids, strict=True)):
        want = fake_logprobs(i, token_id, num_top)
        assert entry.token == tokenizer.decode([token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == want.logprob
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == \
            [(tokenizer.decode([t]), v) for t, v in want.top]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs(harness, tokenizer, stream):
    harness.worker.behavior = answer_with_logprobs
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}],
              "logprobs": True, "top_logprobs": 3}
    if stream:
        content, text = [], ""
        async for chunk in await client(harness).chat.completions.create(**kwargs, stream=True):
            choice = chunk.choices[0]
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                content += choice.logprobs.content
    else:
        resp = await client(harness).chat.completions.create(**kwargs)
        content, text = resp.choices[0].logprobs.content, resp.choices[0].message.content
    assert text == ANSWER
    assert harness.worker.requests[-1].sampling.logprobs == 3
    check_chat_content(content, tokenizer, answer_ids(harness.worker), 3)


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_logprobs(harness, tokenizer, stream):
    harness.worker.behavior = answer_with_logprobs
    kwargs = {"model": MODEL, "prompt": "The capital of France:", "logprobs": 2, "max_tokens": 16}
    tokens, token_logprobs, top, offsets, text = [], [], [], [], ""
    if stream:
        chunks = [c async for c in await client(harness).completions.create(**kwargs, stream=True)]
    else:
        chunks = [await client(harness).completions.create(**kwargs)]
    for c in chunks:
        text += c.choices[0].text
        lp = c.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            token_logprobs += lp.token_logprobs
            top += lp.top_logprobs
            offsets += lp.text_offset
    ids = answer_ids(harness.worker)
    assert text == ANSWER and harness.worker.requests[-1].sampling.logprobs == 2
    assert tokens == [tokenizer.decode([t]) for t in ids]
    assert "".join(tokens[:-1]) == ANSWER  # the hidden EOS token is listed last
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    wants = [fake_logprobs(i, t, 2) for i, t in enumerate(ids)]
    assert token_logprobs == [w.logprob for w in wants]
    # OpenAI's form lists the sampled token among the alternatives even when it is not in the top k.
    assert top == [{**{tokenizer.decode([t]): v for t, v in w.top}, tokenizer.decode([i]): w.logprob}
                   for i, w in zip(ids, wants, strict=True)]


async def test_logprobs_end_at_the_stop_string(harness, tokenizer):
    """A stop string ends the logprobs with the token that completed it, as it ends
    ``completion_tokens``."""
    harness.worker.behavior = answer_with_logprobs
    resp = await client(harness).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, stop=[" the"])
    content = resp.choices[0].logprobs.content
    assert resp.choices[0].message.content == " Paris is"  # " the" completes mid-message
    assert len(content) == resp.usage.completion_tokens < len(answer_ids(harness.worker))
    assert "".join(e.token for e in content) == " Paris is the"


async def test_no_logprobs_when_not_asked(harness):
    harness.worker.behavior = answer_with_logprobs
    resp = await client(harness).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert resp.choices[0].logprobs is None and harness.worker.requests[-1].sampling.logprobs is None
    resp = await client(harness).completions.create(model=MODEL, prompt="hi")
    assert resp.choices[0].logprobs is None


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
])
async def test_logprobs_400(harness, path, body, param):
    base = {"model": MODEL, **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                               else {"prompt": "hi"})}
    r = await harness.http.post(path, json={**base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_token_bytes_round_trip(tokenizer):
    """Token bytes concatenate to the text's UTF-8, a partial character included."""
    texts = TokenTexts(tokenizer)
    text = "naïve café 🙂 日本語"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [texts.get(t) for t in ids]
    assert b"".join(raw for _, raw in pieces) == text.encode("utf-8")
    partial = [s for s, raw in pieces if not _valid_utf8(raw)]
    assert partial and all(s.startswith("bytes:\\x") for s in partial)
    assert texts.get(tokenizer.eos_token_id)[0] == tokenizer.eos_token


def _valid_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
