"""The whole path on the real model: official openai client -> gateway process -> real
Redis stream -> worker process (our engine, SmolLM2 float32 on CPU) -> pub/sub -> SSE."""

from __future__ import annotations

import asyncio

import openai
import pytest

from shared.sampling import SamplingParams

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answer_names_paris_and_usage_matches(smollm_stack, offline, smollm_tokenizer) -> None:
    client = openai.OpenAI(base_url=f"{smollm_stack}/v1", api_key="none")
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    text = resp.choices[0].message.content
    assert "Paris" in text and resp.choices[0].finish_reason == "stop"
    prompt_ids = list(smollm_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                           tokenize=True)["input_ids"])
    (expected,) = offline.generate([prompt_ids], SamplingParams(max_tokens=32, temperature=0.0))
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.total_tokens == len(prompt_ids) + len(expected.token_ids)
    assert text == expected.text


def test_chat_stream_matches_non_stream(smollm_stack) -> None:
    client = openai.OpenAI(base_url=f"{smollm_stack}/v1", api_key="none")
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text and text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_eight_concurrent_streams_equal_single_greedy(smollm_stack, offline) -> None:
    prompts = [f"Write one sentence about the number {i}." if i % 2 else f"Count from {i} to {i + 5}:"
               for i in range(8)]
    # ignore_eos: every stream runs all its tokens (some of these prompts answer EOS at once,
    # which would compare nothing). 16 tokens each keeps the single-request reference cheap.
    num_tokens = 16
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    expected = [offline.generate([p], params)[0] for p in prompts]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, int, list[str]]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=num_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage, finish = "", 0, []
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage, finish

    async def all_of_them() -> list[tuple[str, int, list[str]]]:
        async with openai.AsyncOpenAI(base_url=f"{smollm_stack}/v1", api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(all_of_them())
    for (text, n, finish), exp in zip(results, expected, strict=True):
        assert len(exp.token_ids) == num_tokens and exp.finish_reason == "length"
        assert text == exp.text
        assert (n, finish) == (num_tokens, ["length"])


def test_bad_requests_get_openai_errors(smollm_stack) -> None:
    client = openai.OpenAI(base_url=f"{smollm_stack}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi " * 9000, max_tokens=8)  # max_model_len 8192
    assert "max_model_len" in str(err.value) or "context" in str(err.value).lower()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=-1)
    assert err.value.body["param"] == "temperature"
