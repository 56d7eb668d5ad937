"""``usage.prompt_tokens_details.cached_tokens`` (gateway/choices.py ``usage_of``): the
prompt tokens the worker found in its prefix cache, as OpenAI and vLLM report them.

- The record (``Generation.num_cached_tokens``, fed by hand through the relay): the first
  entry of an attempt sets it, later entries do not, a failover continuation's is capped
  at the prompt's length, an older attempt's is dropped.
- The gateway (the harness's in-test worker, which sends chosen hits; the real ``openai``
  client): non-streamed and streamed, each prompt counted once with ``n`` choices (its
  first choice's hit) and summed over a prompt list.
- End to end (the shared SmolLM2 stack, the real ``openai`` client): a prompt seen for the
  first time has 0; the same long prompt again reports exactly the hit the worker's prefix
  cache counters (``GET /stats``, the worker's heartbeat) grew by, non-streamed and in a
  stream's usage chunk.
"""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

from shared import protocol
from shared.protocol import GenerateRequest, TokenBatch, TokenOutput
from tests.gateway_harness import MODEL, FakeWorker
from tests.test_relay_batches import Requests

pytestmark = pytest.mark.timeout(120)


def entry(request_id: str, first_index: int, token_ids: list[int], *, cached: int, num_prompt: int = 40,
          attempt: int = 0, finish_reason: str | None = None) -> TokenOutput:
    return TokenOutput(request_id=request_id, attempt=attempt, first_index=first_index, token_ids=token_ids,
                       finish_reason=finish_reason, num_prompt_tokens=num_prompt, num_cached_tokens=cached)


# ---- the record --------------------------------------------------------------------------

async def test_first_entry_of_each_attempt_sets_the_hit(smollm_tokenizer) -> None:
    r = Requests(smollm_tokenizer)
    gen = r.add("a")
    assert gen.num_cached_tokens == 0
    r.send(entry("a", 0, [11], cached=32))
    r.send(entry("a", 1, [12], cached=16))  # re-admitted after a preemption: not the request's hit
    assert gen.num_cached_tokens == 32
    # Failover: the continuation's prompt is prompt + delivered outputs; only the prompt counts.
    gen.attempt = 1
    r.send(entry("a", 2, [13], cached=48, attempt=1))
    assert gen.num_cached_tokens == 40
    r.send(entry("a", 3, [14], cached=0, attempt=0))  # the dead worker's late entry: dropped
    assert gen.num_cached_tokens == 40


# ---- the gateway, against the harness's worker ---------------------------------------------

#: The hit the in-test worker reports for child ``k`` of a request (its wire id ends in ``-k``).
CHILD_HITS = [16, 0, 8, 4]


def child_index(request_id: str, num_children: int) -> int:
    return int(request_id.rsplit("-", 1)[1]) if num_children > 1 else 0


def answer_with_hits(num_children: int):
    async def behavior(req: GenerateRequest, w: FakeWorker) -> None:
        hit = CHILD_HITS[child_index(req.request_id, num_children)]  # below every prompt's length here
        ids = w.tok.encode(" Paris", add_special_tokens=False)
        outputs = [entry(req.request_id, 0, ids, cached=hit, num_prompt=len(req.prompt_token_ids)),
                   entry(req.request_id, len(ids), [w.tok.eos_token_id], cached=hit + 1,
                         num_prompt=len(req.prompt_token_ids), finish_reason="stop")]
        for out in outputs:
            await w.client.publish(req.reply_channel, protocol.encode(TokenBatch(worker_id="w1", outputs=[out])))

    return behavior


async def test_chat_with_n_choices_counts_the_prompt_once(harness) -> None:
    harness.worker.behavior = answer_with_hits(3)
    async with openai.AsyncOpenAI(base_url=harness.base_url + "/v1", api_key="none", max_retries=0) as client:
        resp = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], n=3,
            max_tokens=5)
    assert len(resp.choices) == 3
    assert resp.usage.prompt_tokens_details.cached_tokens == CHILD_HITS[0]  # the first choice's, once
    assert resp.usage.prompt_tokens == len(harness.worker.requests[-1].prompt_token_ids)


async def test_streamed_prompt_list_sums_each_prompts_first_choice(harness) -> None:
    harness.worker.behavior = answer_with_hits(4)
    prompts = [list(range(1, 41)), list(range(100, 130))]
    async with openai.AsyncOpenAI(base_url=harness.base_url + "/v1", api_key="none", max_retries=0) as client:
        stream = await client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == 70
    # Choices 0 and 2 are the first of prompts 0 and 1 (index = prompt index * n + choice index).
    assert usage.prompt_tokens_details.cached_tokens == CHILD_HITS[0] + CHILD_HITS[2]
    assert all(c.usage is None for c in chunks[:-1])


async def test_a_miss_reports_zero(harness) -> None:
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


# ---- end to end: the shared SmolLM2 stack ------------------------------------------------

def prefix_counters(url: str) -> tuple[int, int]:
    """``(prefix_cache_queries, prefix_cache_hits)`` of the stack's one worker (tokens),
    as its last heartbeat has them."""
    (w,) = httpx.get(f"{url}/stats", timeout=10).json()["workers"]
    return w["prefix_cache_queries"], w["prefix_cache_hits"]


def counters_after(url: str, before: tuple[int, int], num_prompt_tokens: int) -> tuple[int, int]:
    """The worker's counters once a heartbeat counts the lookup of one more prompt of
    ``num_prompt_tokens`` after ``before`` (heartbeats come every second)."""
    deadline = time.monotonic() + 30
    while True:
        now = prefix_counters(url)
        if now[0] >= before[0] + num_prompt_tokens:
            assert now[0] == before[0] + num_prompt_tokens, (before, now)  # no other request ran
            return now
        assert time.monotonic() < deadline, f"no heartbeat counted the lookup: {before} -> {now}"
        time.sleep(0.2)


LONG_TEXT = ("The city keeps its archives in a building by the river, where clerks have copied the "
             "registers of births, trades and harbour dues since the first charter was granted. ") * 3


@pytest.mark.timeout(300)
def test_same_completion_prompt_twice_reports_the_workers_hit(smollm_stack) -> None:
    client = openai.OpenAI(base_url=f"{smollm_stack}/v1", api_key="none", max_retries=0)
    prompt = f"{uuid.uuid4().hex} {LONG_TEXT}"  # its first block is new to the worker
    before = prefix_counters(smollm_stack)
    first = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    middle = counters_after(smollm_stack, before, first.usage.prompt_tokens)
    assert middle[1] == before[1]  # the worker found nothing either
    second = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=3, temperature=0)
    after = counters_after(smollm_stack, middle, second.usage.prompt_tokens)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached == after[1] - middle[1]


@pytest.mark.timeout(300)
def test_same_chat_twice_streams_the_workers_hit_in_the_usage_chunk(smollm_stack) -> None:
    client = openai.OpenAI(base_url=f"{smollm_stack}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} {LONG_TEXT} Summarise this."}]

    def usage_of_stream() -> openai.types.CompletionUsage:
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=3,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        *_, last = stream
        assert last.choices == [] and last.usage is not None
        return last.usage

    before = prefix_counters(smollm_stack)
    first = usage_of_stream()
    middle = counters_after(smollm_stack, before, first.prompt_tokens)
    # The chat template's opening (system prompt) may be cached from earlier chats: whatever
    # the worker found is what the answer says.
    assert first.prompt_tokens_details.cached_tokens == middle[1] - before[1]
    second = usage_of_stream()
    after = counters_after(smollm_stack, middle, second.prompt_tokens)
    cached = second.prompt_tokens_details.cached_tokens
    assert cached == after[1] - middle[1]
    assert first.prompt_tokens_details.cached_tokens < cached < second.prompt_tokens
