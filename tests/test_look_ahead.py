"""Scheduling a step while the one before it is in flight (worker/engine/scheduler.py,
``Scheduler.ahead_of``; worker/engine/engine.py, ``_look_ahead``): the scheduler's view of
a step not applied yet, on hand-made outputs, then the real SmolLM2 engine (float32,
CPU) with the look ahead on, whose tokens must be the synchronous engine's. On CPU the
steps scheduled ahead run eagerly; on CUDA the same bookkeeping drives the graphs
(``tests/test_engine_cuda.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request, RequestStatus
from worker.engine.scheduler import Scheduler

pytestmark = pytest.mark.timeout(600)

EOS = 0


def _scheduler(num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4, False), max_num_seqs, budget)


def _req(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), frozenset({EOS}))


def test_the_view_counts_the_step_in_flight_and_is_taken_back() -> None:
    s = _scheduler(budget=10)
    a, b = _req("a", 3), _req("b", 20)
    s.add(a)
    s.add(b)
    first = s.schedule()  # a's whole prompt (samples), b's first 7 tokens
    assert [(x.request.request_id, x.num_tokens, x.samples) for x in first.scheduled] == [("a", 3, True),
                                                                                           ("b", 7, False)]
    with s.ahead_of(first) as nxt:
        # a decodes on its token in flight (a 0 on the host), b goes on from token 7.
        assert [(x.request.request_id, x.num_tokens, x.samples) for x in nxt.scheduled] == [("a", 1, True),
                                                                                             ("b", 9, False)]
        assert a.num_pending_tokens == 1 and a.num_computed_tokens == 3
        assert nxt.scheduled[0].input_token_ids() == [0]
        assert nxt.scheduled[1].input_token_ids() == list(range(8, 17))
    assert (a.num_computed_tokens, a.num_pending_tokens, b.num_computed_tokens) == (0, 0, 0)
    s.update(first, [11, None])
    assert (a.token_ids[-1], a.num_computed_tokens, b.num_computed_tokens) == (11, 3, 7)
    s.update(nxt, [12, None])
    assert (a.token_ids[-2:], a.num_computed_tokens, b.num_computed_tokens) == ([11, 12], 4, 16)


def test_a_token_in_flight_that_reaches_max_tokens_is_not_scheduled_again() -> None:
    s = _scheduler()
    a, b = _req("a", 3, max_tokens=1), _req("b", 3, max_tokens=3)
    s.add(a)
    s.add(b)
    first = s.schedule()
    with s.ahead_of(first) as nxt:
        assert [x.request.request_id for x in nxt.scheduled] == ["b"]
    _, finished = s.update(first, [5, 6])
    assert finished == [a] and a.status == RequestStatus.FINISHED_LENGTH


def test_a_sibling_waits_for_blocks_computed_in_the_step_in_flight() -> None:
    """Siblings of one prompt, the first admitted in the step in flight: the step
    scheduled ahead sees that prefill as computed, but its blocks reach the prefix cache
    only when the step is applied, so the second waits instead of computing the prompt
    again; once the step is applied it finds all but the last token cached."""
    s = Scheduler(BlockManager(64, 4, True), 8, 32)
    first_req, second = _req("a", 10), _req("b", 10)
    s.add(first_req)
    s.add(second)
    first = s.schedule()
    assert [x.request.request_id for x in first.scheduled] == ["a"]  # b waits on a's first block
    with s.ahead_of(first) as nxt:
        assert [(x.request.request_id, x.num_tokens) for x in nxt.scheduled] == [("a", 1)]
    s.update(first, [11])
    s.update(nxt, [12])
    third = s.schedule()
    assert [(x.request.request_id, x.num_tokens) for x in third.scheduled] == [("a", 1), ("b", 2)]
    assert second.num_cached_tokens == 8


def test_prompts_ending_in_flight_do_not_cap_the_next_steps_prefill() -> None:
    """With the prefill capped per decoding request (Sarathi-Serve's budget), requests
    whose token in flight is their last decode no more: the step scheduled ahead gives
    the waiting prompts the whole token budget, as the synchronous scheduler would once
    they finished (an offline prefill of 16 prompts took 9 steps instead of 2)."""
    s = Scheduler(BlockManager(1024, 4, False), 32, 1024, prefill_tokens_per_decode=1)
    first_wave = [_req(f"a{i}", 128, max_tokens=1) for i in range(8)]
    second_wave = [_req(f"b{i}", 128, max_tokens=1) for i in range(8)]
    for r in first_wave + second_wave:
        s.add(r)
    first = s.schedule()
    assert [x.request for x in first.scheduled] == first_wave
    with s.ahead_of(first) as nxt:
        assert [x.request for x in nxt.scheduled] == second_wave
        assert sum(x.num_tokens for x in nxt.scheduled) == 1024  # counted, they capped it at 512


def test_a_request_that_stops_on_its_token_in_flight_drops_the_step_after() -> None:
    s = _scheduler()
    a = _req("a", 3, max_tokens=8)
    s.add(a)
    first = s.schedule()
    with s.ahead_of(first) as nxt:
        assert [x.num_tokens for x in nxt.scheduled] == [1]
    _, finished = s.update(first, [EOS])
    assert finished == [a]
    results, finished = s.update(nxt, [9])  # computed on the EOS, dropped
    assert results == [] and finished == [] and a.token_ids[-1] == EOS and not s.requests


def test_a_request_preempted_by_the_look_ahead_keeps_nothing_of_the_step_in_flight() -> None:
    # 4 blocks of 4 tokens: a (7 tokens) and b (8) fill 4 blocks once b's token in flight
    # needs a fifth position block; the look ahead preempts b, the last admitted.
    s = _scheduler(num_blocks=4, budget=32)
    a, b = _req("a", 7, max_tokens=4), _req("b", 8, max_tokens=4)
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert [x.num_tokens for x in first.scheduled] == [7, 8]
    with s.ahead_of(first) as nxt:
        assert nxt.preempted == [b] and [x.request for x in nxt.scheduled] == [a]
    assert (b.status, b.num_computed_tokens, b.num_pending_tokens, b.block_table) == (RequestStatus.PREEMPTED,
                                                                                       0, 0, [])
    results, _ = s.update(first, [21, 22])
    assert [r.request for r in results] == [a] and b.num_output_tokens == 0
    s.update(nxt, [23])
    assert a.output_token_ids == [21, 23]


def _run(engine, prompts: list[list[int]], params: list[SamplingParams],
         abort_after_first: str | None = None, hook: Callable[[], None] | None = None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", ids, p)
        tokens[f"r{i}"] = []
    for _ in range(5_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.first_index == len(tokens[out.request_id])
            tokens[out.request_id].extend(out.new_token_ids)
            if out.request_id == abort_after_first:
                engine.abort(out.request_id)
        if hook is not None:
            hook()
    assert not engine.has_unfinished_requests()
    return tokens


@pytest.fixture(scope="module")
def engine(smollm_source):
    from worker.engine.engine import LLMEngine

    # 16 blocks of 16 tokens for 6 sequences of up to ~140 tokens: preemptions happen;
    # 48-token steps chunk every prompt and mix chunks with decodes.
    return LLMEngine(smollm_source, ModelSettings(max_model_len=512),
                     EngineSettings(num_kv_blocks=16, max_num_seqs=6, max_num_batched_tokens=48))


def test_the_engine_looking_ahead_gives_the_synchronous_tokens(engine) -> None:
    prompts = [[(7 * i + 3 * k) % 9000 + 20 for k in range(n)] for i, n in enumerate((9, 70, 33, 120, 5, 61, 17))]
    greedy = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (24, 3, 40, 16, 1, 30, 12)]
    greedy[5] = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)  # seeded
    engine.look_ahead = False
    reference = _run(engine, prompts, greedy)
    # A stop token the greedy run reaches by its 4th output stops the request on a token
    # in flight; a request aborted after its first token leaves a step in flight behind.
    stop = reference["r2"][3]
    greedy[2] = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,))
    reference = _run(engine, prompts, greedy, abort_after_first="r6")
    assert 1 < len(reference["r2"]) <= 4 and reference["r2"][-1] == stop and len(reference["r6"]) == 1
    preemptions, launched = engine.scheduler.num_preemptions, []
    launch_step = engine.runner.launch_step

    def spy(batch, *args, **kwargs):
        launched.append([(item.num_tokens, item.samples) for item in batch])
        return launch_step(batch, *args, **kwargs)

    engine.runner.launch_step = spy
    engine.look_ahead = True
    try:
        ahead = _run(engine, prompts, greedy, abort_after_first="r6")
    finally:
        engine.look_ahead = False
        del engine.runner.launch_step
    assert ahead == reference
    assert engine.num_steps_ahead > 0 and engine.num_async_steps > 0
    # Steps that carried prefill chunks beside decodes were scheduled ahead, and the look
    # ahead preempted (the cache is short) without losing a token.
    assert any(any(n > 1 for n, _ in step) and any(n == 1 for n, _ in step) for step in launched)
    assert engine.scheduler.num_preemptions > preemptions
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
