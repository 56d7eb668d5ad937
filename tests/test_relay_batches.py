"""The relay at GPU rates (docs/architecture.md, "The relay"): a worker publishes one
``TokenBatch`` per gateway per engine step; the gateway's relay hands each entry to its
request's one record (``Generation``) in one pass, which orders, detokenizes
(``DecodeStream``, checked against the Python window detokenizer) and delivers it; SSE
text chunks are encoded without building dicts. Real SmolLM2 tokenizer; the worker side
runs the sim backend against a real redis-server. The 1,000-stream test through real
processes is tests/test_relay_1000_streams.py."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.detokenizer import StreamDetokenizer, WindowDetokenizer, make_detokenizer
from gateway.errors import OpenAIError
from gateway.generation import Generation
from gateway.output import OutputProcessor, Step
from gateway.relay import Relay
from gateway.responses import ResponseShape, sse_event
from shared import protocol
from shared.keys import STREAM_FIELD, Keys
from shared.protocol import ErrorMessage, GenerateRequest, TokenBatch, TokenOutput
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from tests.test_worker_paths import RecordingSim
from worker.service import Worker

pytestmark = pytest.mark.timeout(120)

REPLACEMENT_CHAR = "\ufffd"


# -- incremental detokenization ---------------------------------------------------------

def _run(detok: Any, ids: list[int]) -> list[str]:
    """Per-token texts, then the flush."""
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_decode_stream_matches_the_window_detokenizer_on_random_sequences(smollm_tokenizer) -> None:
    """Random outputs rich in what is hard (tokens that are single UTF-8 bytes, so
    characters split across tokens, and special tokens to skip): per token, the same
    text from both; prompts end on a character boundary (as text prompts and chat
    templates do; the other case is the next test)."""
    tok = smollm_tokenizer
    vocab_size = len(tok)
    byte_ids = [i for i in range(vocab_size) if tok.decode([i]) == REPLACEMENT_CHAR]
    assert len(byte_ids) > 100
    special_ids = list(tok.all_special_ids)
    rng = random.Random(0)

    def token() -> int:
        kind = rng.random()
        return rng.choice(byte_ids) if kind < 0.3 else rng.choice(special_ids) if kind < 0.35 \
            else rng.randrange(vocab_size)

    num_split_chars = 0
    for _ in range(1000):
        prompt = [token() for _ in range(rng.randrange(0, 8))]
        while prompt and tok.decode(prompt[-5:], skip_special_tokens=True).endswith(REPLACEMENT_CHAR):
            prompt.pop()
        ids = [token() for _ in range(rng.randrange(1, 40))]
        window = _run(WindowDetokenizer(tok, prompt), ids)
        stream = _run(StreamDetokenizer(tok.backend_tokenizer, prompt), ids)
        assert stream == window, (prompt, ids)
        num_split_chars += sum(1 for text in stream[:-1] if text == "")
    assert num_split_chars > 1000  # held tokens (split characters, specials) were common


def test_a_prompt_ending_inside_a_character_stays_out_of_the_output(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    char_ids = tok.encode("日", add_special_tokens=False)
    assert len(char_ids) > 1
    prompt = tok.encode("Say:", add_special_tokens=False) + char_ids[:-1]
    ids = tok.encode(" Paris", add_special_tokens=False)
    assert "".join(_run(StreamDetokenizer(tok.backend_tokenizer, prompt), ids)) == " Paris"


def test_an_output_ending_inside_a_character_is_flushed_as_a_replacement_char(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    ids = tok.encode(" Paris 日", add_special_tokens=False)[:-1]
    texts = _run(StreamDetokenizer(tok.backend_tokenizer), ids)
    assert "".join(texts[:-1]) == " Paris" and texts[-1].endswith(REPLACEMENT_CHAR)


def test_a_decoder_that_rewrites_sent_text_restarts_the_stream() -> None:
    """``DecodeStream`` raises when new text no longer extends the text already sent (a
    decoder that is not prefix-stable; here "ab" decodes as "X"): the detokenizer
    starts a new stream at that token instead of failing the request."""
    from tokenizers import Tokenizer, decoders, models

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    assert backend.decode([0, 1, 2]) == "Xc"
    assert _run(StreamDetokenizer(backend), [2, 0, 1, 2]) == ["c", "a", "", "c", ""]


def test_make_detokenizer_streams_with_a_rust_tokenizer_only(smollm_tokenizer) -> None:
    assert isinstance(make_detokenizer(smollm_tokenizer), StreamDetokenizer)

    class Wrapped:  # a tokenizer whose backend is not a tokenizers.Tokenizer
        backend_tokenizer = object()

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return smollm_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(make_detokenizer(Wrapped()), WindowDetokenizer)


# -- SSE chunks -----------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True])
def test_text_chunks_are_the_dict_form_byte_for_byte(chat: bool) -> None:
    shape = ResponseShape('cmpl-a"b\\c', "m/é", 1_700_000_000, chat)
    rng = random.Random(1)
    alphabet = 'ab "\\/\n\t\x00\x01\x1f\x7f é日本🎉\u2028'
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
        event = shape.chunk_event(text)
        assert event == sse_event(shape.chunk(text))
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        body = json.loads(event[len(b"data: "):])
        assert body == shape.chunk(text)
        assert (body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]) == text
    for finish_reason in ("stop", "length"):
        assert shape.chunk_event("", finish_reason) == sse_event(shape.chunk("", finish_reason))


# -- the relay's pass over a batch -----------------------------------------------------------

class Requests:
    """Generations registered on a relay that is fed by hand (``dispatch``), no Redis."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.orphan_calls: list[list[str]] = []
        client = aioredis.Redis(unix_socket_path="/nonexistent")  # never used: dispatch is synchronous
        self.relay = Relay(client, "test:gateway:g", on_orphans=self.orphan_calls.append)

    def add(self, request_id: str, *, stops: tuple[str, ...] = (), deadline_in_s: float = 60.0,
            attempt: int = 0, streaming: bool = True) -> Generation:
        processor = OutputProcessor(self.tok, [], list(stops), {self.tok.eos_token_id})
        now_s = time.monotonic()
        gen = Generation(request_id=request_id, processor=processor, arrival_s=now_s,
                         deadline_s=now_s + deadline_in_s, on_close=lambda g: self.relay.unregister(g.request_id),
                         is_disconnected=None if streaming else _never_disconnected)
        self.relay.register(gen)
        message = GenerateRequest(request_id=request_id, model="m", prompt_token_ids=[1], sampling=SamplingParams(),
                                  reply_channel=self.relay.channel, deadline_unix_s=time.time() + deadline_in_s,
                                  attempt=attempt)
        gen.attempt = attempt
        gen.submitted(message, b"1-0")
        return gen

    def send(self, *outputs: TokenOutput, worker_id: str = "w1") -> None:
        self.relay.dispatch(protocol.encode(TokenBatch(worker_id=worker_id, outputs=list(outputs))))

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)


def out(request_id: str, first_index: int, token_ids: list[int], finish_reason: str | None = None,
        attempt: int = 0) -> TokenOutput:
    return TokenOutput(request_id=request_id, attempt=attempt, first_index=first_index, token_ids=token_ids,
                       finish_reason=finish_reason)


async def texts(gen: Generation) -> tuple[list[str], OpenAIError | None]:
    """The texts of every step ``updates`` yields, and the error it ends with."""
    got: list[Step] = []
    try:
        async for steps in gen.updates():
            got.extend(steps)
    except OpenAIError as exc:
        return [s.text for s in got], exc
    return [s.text for s in got], None


async def test_one_batch_feeds_every_request_in_one_pass(smollm_tokenizer) -> None:
    r = Requests(smollm_tokenizer)
    a, b, c = r.add("a"), r.add("b", stops=(" is",)), r.add("c", attempt=1)
    paris = r.ids(" Paris is the capital")
    eos = smollm_tokenizer.eos_token_id
    r.send(out("a", 0, paris[:2]), out("b", 0, paris[:1]), out("c", 0, [99], attempt=0),  # c: an older attempt
           out("gone", 5, [7]), out("gone-too", 0, [7]), out("done-elsewhere", 3, [7], "length"))
    assert r.orphan_calls == [["gone", "gone-too"]]  # one abort for the batch's orphans; finished ones need none
    r.send(out("a", 2, paris[2:], None), out("b", 1, paris[1:3]), out("c", 0, paris[:1], attempt=1),
           out("gone", 6, [7]))
    assert r.orphan_calls == [["gone", "gone-too"]]  # each orphan is reported once
    r.send(out("a", 2, paris[2:] + [eos], "stop"), out("c", 1, [eos], "stop", attempt=1))
    assert await texts(a) == ([" Paris is", " the capital", ""], None)
    assert a.finish_reason == "stop" and a.num_output_tokens == len(paris) + 1 and a.worker_done
    assert await texts(b) == ([" Par", "is"], None)  # " is" matched (held back: could start it), ends it
    assert b.stop_string == " is" and not b.worker_done and b.abort_reason == "stop string"
    assert await texts(c) == ([" Paris", ""], None)
    assert c.output_ids == paris[:1] + [eos] and a.worker_id == "w1"
    assert r.relay.num_dropped == 5  # c's old attempt, four entries of unknown requests


async def test_a_request_whose_entry_breaks_fails_alone(smollm_tokenizer) -> None:
    r = Requests(smollm_tokenizer)
    bad, gap, good = r.add("bad"), r.add("gap"), r.add("good")
    paris = r.ids(" Paris")
    r.send(out("bad", 0, [-1]), out("gap", 1, paris), out("good", 0, paris, "length"))
    got, error = await texts(bad)
    assert got == [] and error is not None and error.status == 500 and "internal error" in error.message
    got, error = await texts(gap)
    assert error is not None and error.code == "missing_tokens" and gap.abort_reason == "error 500"
    assert await texts(good) == ([" Paris"], None)


async def test_worker_errors_deadlines_and_a_lost_relay_fail_with_their_status(smollm_tokenizer) -> None:
    r = Requests(smollm_tokenizer)
    err, late, lost = r.add("err"), r.add("late", deadline_in_s=0.05), r.add("lost")
    r.send(out("lost", 0, r.ids(" Paris")))
    r.relay.dispatch(protocol.encode(ErrorMessage(request_id="err", attempt=0, worker_id="w1", status=400,
                                                  message="bad sampling")))
    got, error = await texts(err)
    assert error is not None and (error.status, error.message) == (400, "bad sampling") and err.worker_done
    got, error = await texts(late)  # no timer per token: one per request, its deadline
    assert error is not None and error.status == 504 and late.abort_reason == "deadline"
    r.relay._fail_all("lost the connection to Redis")
    got, error = await texts(lost)
    assert got == [" Paris"] and error is not None and error.status == 503  # steps before the loss first


async def test_a_non_streaming_request_wakes_once_at_the_end(smollm_tokenizer) -> None:
    r = Requests(smollm_tokenizer)
    gen = r.add("whole", streaming=False)
    paris = r.ids(" Paris is the capital")
    result = asyncio.ensure_future(gen.result())
    for _ in range(10):  # result() -> wait_for's task -> the waiter
        await asyncio.sleep(0)
    waiter = gen._waiter  # the handler's one future
    assert waiter is not None
    for i, token_id in enumerate(paris):
        r.send(out("whole", i, [token_id]))
        assert not waiter.done()  # tokens do not wake the handler
    r.send(out("whole", len(paris), [smollm_tokenizer.eos_token_id], "stop"))
    assert waiter.done()
    assert await result == " Paris is the capital"


async def _never_disconnected() -> bool:
    return False


# -- the worker's side: one PUBLISH per gateway per step ---------------------------------------

KEYS = Keys("trb")
STREAM = KEYS.requests_stream("m")
PROMPT = [5, 6, 7]


async def _queue(client: aioredis.Redis, request_id: str, channel: str, max_tokens: int) -> None:
    request = GenerateRequest(request_id=request_id, model="m", prompt_token_ids=PROMPT,
                              sampling=SamplingParams(max_tokens=max_tokens), reply_channel=channel,
                              deadline_unix_s=time.time() + 60)
    await client.xadd(STREAM, {STREAM_FIELD: protocol.encode(request)})


async def _batches(pubsub: aioredis.client.PubSub, num_tokens: int, request_ids: set[str]) -> list[TokenBatch]:
    """The batches on one channel until each of ``request_ids`` got ``num_tokens`` tokens."""
    got: list[TokenBatch] = []
    counts = dict.fromkeys(request_ids, 0)
    deadline_s = time.monotonic() + 30
    while any(n < num_tokens for n in counts.values()):
        assert time.monotonic() < deadline_s, counts
        item = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if item is not None:
            batch = protocol.decode(item["data"])
            assert isinstance(batch, TokenBatch)
            got.append(batch)
            for entry in batch.outputs:
                counts[entry.request_id] += len(entry.token_ids)
    return got


async def test_the_worker_publishes_one_batch_per_gateway_per_step(client) -> None:
    backend = RecordingSim(ModelSettings(max_model_len=64), EngineSettings(max_num_seqs=8), step_time_ms=5.0)
    worker = Worker(client, KEYS, "m", "w1", backend)
    channels = [KEYS.gateway_channel(g) for g in ("g1", "g2")]
    subs = []
    for channel in channels:
        subs.append(client.pubsub())
        await subs[-1].subscribe(channel)
    # queued before the worker starts: all five run from its first step on
    for request_id, channel in (("a", 0), ("b", 0), ("c", 0), ("d", 1), ("e", 1)):
        await _queue(client, request_id, channels[channel], 6)
    await _queue(client, "orphan-1", KEYS.gateway_channel("gone"), 50)
    await _queue(client, "orphan-2", KEYS.gateway_channel("gone"), 50)
    running = asyncio.create_task(worker.run())
    try:
        first, second = await asyncio.gather(_batches(subs[0], 6, {"a", "b", "c"}), _batches(subs[1], 6, {"d", "e"}))
    finally:
        worker.drain()
        await asyncio.wait_for(running, 10)
        for sub in subs:
            await sub.aclose()
    for batches, request_ids in ((first, ["a", "b", "c"]), (second, ["d", "e"])):
        assert len(batches) == 6  # one message per step, each with all of the gateway's requests
        for index, batch in enumerate(batches):
            assert batch.worker_id == "w1"
            assert [e.request_id for e in batch.outputs] == request_ids
            assert all(e.first_index == index and e.token_ids == [PROMPT[index % 3]] for e in batch.outputs)
        assert all(e.finish_reason == "length" for e in batches[-1].outputs)
    # The batch of the gateway that is gone reached no subscriber: both its requests were
    # aborted after their first step, not run to their 50 tokens.
    assert sorted(backend.aborted) == ["orphan-1", "orphan-2"] and worker.inflight == {}
    assert worker.num_steps < 50
