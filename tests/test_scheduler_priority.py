"""Priority classes inside a worker (issue 15, item 1, engine side): waiting requests are
admitted in (priority, arrival) order, and a waiting request that finds no sequence slot
or KV blocks preempts (recompute) running requests of a strictly lower class, the lowest
class and most recently admitted first; never one of its own class.

The scheduler is driven with hand-made tokens (no model); the engine with a tiny Llama of
dummy weights (float32, CPU) shows that preempted requests still produce exactly their
unpreempted greedy tokens; the sim backend and the worker's Redis adapter carry
``GenerateRequest.priority`` through.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from shared import protocol
from shared.keys import STREAM_FIELD, Keys
from shared.model_source import ModelSource
from shared.protocol import GenerateRequest
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from tests.test_worker_paths import replies_until_finished, running
from worker.backends.sim import SimBackend
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request, RequestStatus
from worker.engine.scheduler import MAX_PRIORITY_PAUSES, Scheduler
from worker.service import Worker

pytestmark = pytest.mark.timeout(120)

INTERACTIVE, DEFAULT, BATCH = 0, 1, 2
BLOCK_SIZE = 4


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False), max_num_seqs, budget)


def req(rid: str, num_prompt_tokens: int, priority: int, max_tokens: int = 8) -> Request:
    """A request whose prompt shares no token with another id's (no prefix hits)."""
    base = 1000 * (sum(map(ord, rid)) % 40)
    return Request(rid, [base + j for j in range(1, num_prompt_tokens + 1)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority)


def step(s: Scheduler) -> tuple[dict[str, int], list[str]]:
    """One step with made-up tokens: ``({request id: tokens scheduled}, preempted ids)``."""
    out = s.schedule()
    s.update(out, [7 if item.samples else None for item in out.scheduled])
    return {item.request.request_id: item.num_tokens for item in out.scheduled}, [r.request_id for r in out.preempted]


def ids(requests: Any) -> list[str]:
    return [r.request_id for r in requests]


def run_to_end(s: Scheduler, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not s.requests:
            assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
            return
        step(s)
    raise AssertionError(f"not finished after {max_steps} steps: {ids(s.requests.values())}")


# -- the scheduler ---------------------------------------------------------------------------

def test_interactive_arrival_takes_a_full_batchs_latest_slot() -> None:
    s = make(max_num_seqs=2)
    s.add(req("b1", 8, BATCH))
    s.add(req("b2", 8, BATCH))
    step(s)
    step(s)
    b2 = s.requests["b2"]
    s.add(req("i", 8, INTERACTIVE))
    counts, preempted = step(s)
    assert counts == {"i": 8} and preempted == ["b2"]  # b1's decode pauses for i's prefill
    assert s.num_preemptions == 1 and s.make_stats().num_preemptions == 1
    assert b2.status == RequestStatus.PREEMPTED and b2.num_computed_tokens == 0 and not b2.block_table
    assert ids(s.running) == ["i", "b1"] and ids(s.waiting) == ["b2"]
    run_to_end(s)
    assert b2.num_output_tokens == 8 and b2.num_preemptions == 1


def test_kv_shortage_preempts_the_lowest_class_latest_first_until_it_fits() -> None:
    # 12 blocks of 4 tokens: b1 and b2 (batch) hold 2 each, d1 (default, admitted later
    # but ahead of them in class order, prefilled in a step that paused them) 2; 6 are
    # free. The interactive prompt needs 10: b2 (2 more) is not enough, b1 too is, d1
    # stays (and pauses).
    s = make(num_blocks=12)
    s.add(req("b1", 8, BATCH))
    s.add(req("b2", 8, BATCH))
    step(s)
    s.add(req("d1", 8, DEFAULT))
    step(s)
    assert ids(s.running) == ["d1", "b1", "b2"]
    s.add(req("i", 40, INTERACTIVE))
    counts, preempted = step(s)
    assert preempted == ["b2", "b1"] and counts == {"i": 40}
    assert ids(s.running) == ["i", "d1"] and ids(s.waiting) == ["b1", "b2"]  # back in class order
    run_to_end(s)
    assert s.num_preemptions >= 2


@pytest.mark.parametrize("arrival", [BATCH, BATCH + 1], ids=["same-class", "lower-class"])
def test_no_preemption_for_an_equal_or_lower_class(arrival: int) -> None:
    # Out of slots, then out of blocks: b1 and b2 grow to 4 blocks each, and the late
    # 20-token prompt needs 5 when 4 are free; b1 and b2 finish without preemption.
    for num_blocks, max_num_seqs in [(64, 2), (10, 8)]:
        s = make(num_blocks=num_blocks, max_num_seqs=max_num_seqs)
        s.add(req("b1", 8, BATCH))
        s.add(req("b2", 8, BATCH))
        step(s)
        s.add(req("late", 20, arrival))
        counts, preempted = step(s)
        assert counts == {"b1": 1, "b2": 1} and preempted == [] and ids(s.waiting) == ["late"]
        run_to_end(s)
        assert s.num_preemptions == 0


def test_waiting_requests_are_admitted_in_class_then_arrival_order() -> None:
    s = make(max_num_seqs=1)
    s.add(req("first", 4, INTERACTIVE, max_tokens=2))
    step(s)
    for rid, priority in [("b1", BATCH), ("d1", DEFAULT), ("i1", INTERACTIVE), ("d2", DEFAULT), ("i2", INTERACTIVE)]:
        s.add(req(rid, 4, priority, max_tokens=1))
    assert ids(s.waiting) == ["i1", "i2", "d1", "d2", "b1"]
    admitted = []
    for _ in range(20):
        counts, preempted = step(s)
        assert not preempted  # no waiting request is ever above the running one
        admitted += [rid for rid in counts if rid not in admitted and rid != "first"]
    assert admitted == ["i1", "i2", "d1", "d2", "b1"] and not s.requests


def test_a_preempted_request_resumes_ahead_of_its_class_behind_higher_ones() -> None:
    s = make(max_num_seqs=1)
    s.add(req("b1", 4, BATCH))
    step(s)
    s.add(req("b2", 4, BATCH))
    s.add(req("d1", 4, DEFAULT))
    counts, preempted = step(s)  # d1 may preempt b1 (its class is below d1's)
    assert counts == {"d1": 4} and preempted == ["b1"]
    assert ids(s.waiting) == ["b1", "b2"]
    s.add(req("i1", 4, INTERACTIVE))
    s.add(req("d2", 4, DEFAULT))
    assert ids(s.waiting) == ["i1", "d2", "b1", "b2"]
    run_to_end(s)


def test_after_a_priority_preemption_only_higher_classes_are_admitted() -> None:
    """The victim, back in the queue, is not admitted again in the same step (nor
    anything of its class), even where what it freed would hold its first chunk. (In a
    step that may pause v's class, the pause keeps it out too: this is one that may not.)"""
    s = make(num_blocks=10, budget=20)
    s.add(req("v", 24, BATCH))
    for _ in range(3):  # two prefill chunks, one decode: 7 of the 10 blocks
        step(s)
    s.add(req("i", 16, INTERACTIVE))
    s.num_paused_steps = MAX_PRIORITY_PAUSES
    counts, preempted = step(s)
    # i takes 16 tokens (4 blocks) of the budget; 6 blocks and 4 tokens would fit a chunk of v.
    assert preempted == ["v"] and counts == {"i": 16}
    assert ids(s.waiting) == ["v"] and s.block_manager.num_free_blocks == 6
    run_to_end(s)


def test_a_higher_class_prefill_pauses_lower_class_decodes_for_its_step() -> None:
    """The step that prefills a request of a class above a running one carries only
    that class and the higher ones: the lower ones' decodes (and admissions) wait one
    step, keeping their blocks; a same-class arrival pauses nobody."""
    s = make()
    for rid, priority in [("b1", BATCH), ("b2", BATCH), ("d1", DEFAULT)]:
        s.add(req(rid, 4, priority))
    step(s)
    s.add(req("b3", 4, BATCH))
    assert step(s) == ({"d1": 1, "b1": 1, "b2": 1, "b3": 4}, [])  # same class as the lowest: no pause
    held = {r.request_id: list(r.block_table) for r in s.running}
    s.add(req("d2", 4, DEFAULT))
    s.add(req("b4", 4, BATCH))
    assert step(s) == ({"d1": 1, "d2": 4}, [])  # batch decodes and b4 wait
    assert all(s.requests[rid].block_table == blocks and s.requests[rid].status == RequestStatus.RUNNING
               for rid, blocks in held.items() if rid.startswith("b"))
    s.add(req("i", 4, INTERACTIVE))
    assert step(s) == ({"i": 4}, [])  # every default and batch request waits
    assert step(s) == ({"i": 1, "d1": 1, "d2": 1, "b1": 1, "b2": 1, "b3": 1, "b4": 4}, [])
    run_to_end(s)
    assert s.num_preemptions == 0


def test_a_prefill_in_chunks_pauses_lower_classes_until_its_last_chunk() -> None:
    s = make(budget=8)
    s.add(req("b", 4, BATCH))
    step(s)
    s.add(req("i", 12, INTERACTIVE))
    assert step(s) == ({"i": 8}, [])
    assert step(s) == ({"i": 4}, [])  # running, still mid-prefill: b waits
    assert step(s) == ({"i": 1, "b": 1}, [])


def test_lower_class_pauses_are_bounded() -> None:
    """A higher class that prefills in every step (a new request each step) pauses a
    lower class at most ``MAX_PRIORITY_PAUSES`` steps in a row; the step after carries it."""
    s = make(num_blocks=256, max_num_seqs=32)
    s.add(req("b", 4, BATCH, max_tokens=6))
    step(s)  # b's first token
    gaps, gap = [], 0
    for n in range(40):
        s.add(req(f"i{n}", 4, INTERACTIVE, max_tokens=1))
        counts, _ = step(s)
        if "b" in counts:
            gaps.append(gap)
            gap = 0
        else:
            gap += 1
        if "b" not in s.requests:
            break
    assert "b" not in s.requests and gaps == [MAX_PRIORITY_PAUSES] * 5  # its 5 decodes


def test_async_decode_chain_yields_to_a_waiting_higher_class() -> None:
    """``can_schedule_next_decode`` (a decode behind one in flight) must not keep a full
    batch of a lower class decoding while a higher class waits: the next step is
    scheduled normally, where it preempts. An equal class waits, as before."""
    s = make(max_num_seqs=2)
    s.add(req("b1", 4, BATCH))
    s.add(req("b2", 4, BATCH))
    step(s)
    out = s.schedule()
    assert s.can_schedule_next_decode(out)
    s.add(req("b3", 4, BATCH))
    assert s.can_schedule_next_decode(out)
    s.add(req("i", 4, INTERACTIVE))
    assert not s.can_schedule_next_decode(out)


def test_num_admittable_per_class_counts_lower_classes_as_room() -> None:
    """A full engine of batch requests admits no more requests, but has room for
    interactive ones: the worker may pull those, and they preempt their way in."""
    s = make(num_blocks=12, max_num_seqs=3)
    for rid in ("b1", "b2", "b3"):
        s.add(req(rid, 12, BATCH))  # 3 blocks each, 4 with their first decode
    step(s)
    s.add(req("b4", 4, BATCH))
    step(s)
    assert s.num_admittable() == 0 and s.num_admittable(BATCH) == 0
    assert s.num_admittable(INTERACTIVE) == 3 and s.num_admittable(DEFAULT) == 3
    s.add(req("i", 4, INTERACTIVE))
    assert s.num_admittable(INTERACTIVE) == 2
    counts, preempted = step(s)
    assert "i" in counts and preempted == ["b3"]
    assert s.num_admittable(INTERACTIVE) == 2 and s.num_admittable() == 0


# -- the engine: preempted requests still give their own tokens -------------------------------

#: A tiny Llama with dummy weights: greedy tokens are deterministic, and the engine runs
#: in well under a second per request on the CPU.
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "eos_token_id": 0}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Any:
    from worker.engine.engine import LLMEngine

    # 12 blocks of 4 tokens: three 8-token requests and a 24-token one do not fit at once.
    return LLMEngine(ModelSource("tiny", None, dict(TINY), dummy=True),
                     ModelSettings(device="cpu", dtype="float32", max_model_len=256),
                     EngineSettings(num_kv_blocks=12, block_size=BLOCK_SIZE, max_num_seqs=8,
                                    max_num_batched_tokens=64, attention_backend="torch"))


def generate(engine: Any, requests: list[tuple[str, list[int], int]], late: tuple[str, list[int], int] | None = None,
             late_step: int = 2, max_steps: int = 200) -> tuple[dict[str, list[int]], list[set[str]]]:
    """Run ``(id, prompt, priority)`` requests greedily to their end, adding ``late``
    before step ``late_step``; returns each one's output and the ids that got a token,
    per step."""
    outs: dict[str, list[int]] = {}
    per_step: list[set[str]] = []
    for rid, prompt, priority in requests:
        engine.add_request(rid, prompt, GREEDY, priority=priority)
        outs[rid] = []
    for n in range(max_steps):
        if late is not None and n == late_step:
            engine.add_request(late[0], late[1], GREEDY, priority=late[2])
            outs[late[0]] = []
        elif not engine.has_unfinished_requests():
            return outs, per_step
        got = engine.step()
        for out in got:
            assert out.first_index == len(outs[out.request_id])
            outs[out.request_id] += out.new_token_ids
        per_step.append({out.request_id for out in got})
    raise AssertionError(f"not finished after {max_steps} steps")


def test_preempted_requests_give_their_unpreempted_tokens(engine) -> None:
    rng = random.Random(0)
    prompts = {rid: [rng.randrange(1, 256) for _ in range(n)] for rid, n in [("b1", 8), ("b2", 8), ("d1", 8),
                                                                              ("i", 24)]}
    background = [("b1", prompts["b1"], BATCH), ("b2", prompts["b2"], BATCH), ("d1", prompts["d1"], DEFAULT)]
    expected, _ = generate(engine, background)
    (expected_i,) = generate(engine, [("i", prompts["i"], INTERACTIVE)])[0].values()
    before = engine.stats().num_preemptions
    got, per_step = generate(engine, background, late=("i", prompts["i"], INTERACTIVE))
    # The step it arrived before: prefilled and sampled at once, alone (the others pause).
    assert per_step[2] == {"i"}
    assert engine.stats().num_preemptions > before
    assert got == {**expected, "i": expected_i}
    assert all(len(out) == GREEDY.max_tokens for out in got.values())
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, 12)


# -- the sim backend and the worker --------------------------------------------------------------

def test_sim_backend_preempts_a_lower_class_for_a_slot() -> None:
    sim = SimBackend(ModelSettings(max_model_len=1000), EngineSettings(max_num_seqs=1), step_time_ms=0.0)
    sim.add_request("b", [5, 6, 7], SamplingParams(max_tokens=4), priority=BATCH)
    assert [out.request_id for out in sim.step()] == ["b"]
    sim.add_request("d", [8, 9], SamplingParams(max_tokens=2), priority=DEFAULT)
    sim.add_request("i", [1, 2], SamplingParams(max_tokens=2), priority=INTERACTIVE)
    order = [out.request_id for _ in range(8) for out in sim.step()]
    assert order == ["i", "i", "d", "d", "b", "b", "b"]
    assert sim.stats().num_preemptions == 1 and not sim.has_unfinished_requests()
    sim.add_request("x", [1], SamplingParams(max_tokens=3), priority=INTERACTIVE)
    sim.step()
    sim.add_request("y", [2], SamplingParams(max_tokens=1), priority=INTERACTIVE)
    assert [out.request_id for _ in range(4) for out in sim.step()] == ["x", "x", "y"]  # same class: waits
    assert sim.stats().num_preemptions == 1
    sim.add_request("z", [3], SamplingParams(max_tokens=5), priority=BATCH)
    sim.step()
    assert sim.num_admittable() == sim.num_admittable(BATCH) == 0 and sim.num_admittable(DEFAULT) == 1


class PrioritySim(SimBackend):
    """The sim backend, recording each added request's ``(id, priority)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.added: list[tuple[str, int]] = []

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] | None = None, priority: int = 0, tenant: str = "",
                    **kwargs: Any) -> None:
        super().add_request(request_id, prompt_token_ids, sampling, output_token_ids, priority, tenant, **kwargs)
        self.added.append((request_id, priority))


async def test_worker_passes_the_generate_request_priority_to_the_engine(client) -> None:
    keys = Keys("tprio")
    channel = keys.gateway_channel("g1")
    backend = PrioritySim(ModelSettings(max_model_len=1000), EngineSettings(max_num_seqs=4), step_time_ms=1.0)
    worker = Worker(client, keys, "m", "w1", backend)
    pubsub = client.pubsub()
    await pubsub.subscribe(channel)
    try:
        for rid, priority in [("b", BATCH), ("i", INTERACTIVE), ("d", DEFAULT)]:
            request = GenerateRequest(request_id=rid, model="m", prompt_token_ids=[5, 6], reply_channel=channel,
                                      sampling=SamplingParams(max_tokens=2), deadline_unix_s=time.time() + 60,
                                      priority=priority)
            await client.xadd(keys.requests_stream("m"), {STREAM_FIELD: protocol.encode(request)})
        async with running(worker):
            replies = await asyncio.wait_for(replies_until_finished(pubsub, {"b", "i", "d"}), 30)
    finally:
        await pubsub.aclose()
    assert sorted(backend.added) == [("b", BATCH), ("d", DEFAULT), ("i", INTERACTIVE)]
    assert all(r[-1].finish_reason == "length" for r in replies.values())


class CountingSim(SimBackend):
    """The sim backend, counting steps started and completed, and recording after how
    many completed steps each request was added."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_started = self.num_done = 0
        self.added_after: dict[str, int] = {}

    def add_request(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        super().add_request(request_id, *args, **kwargs)
        self.added_after[request_id] = self.num_done

    def step(self) -> list[Any]:
        self.num_started += 1
        out = super().step()
        self.num_done += 1
        return out


async def test_a_busy_worker_admits_a_request_that_arrived_during_a_step_in_the_next(client) -> None:
    """The worker pulls between steps, so a request queued while step k runs is added
    before step k + 1 (a pull overlapped with step k, started before it arrived, would
    leave it for step k + 2)."""
    keys = Keys("tcadence")
    channel = keys.gateway_channel("g1")
    backend = CountingSim(ModelSettings(max_model_len=1000), EngineSettings(max_num_seqs=4), step_time_ms=250.0)
    worker = Worker(client, keys, "m", "w1", backend)
    pubsub = client.pubsub()
    await pubsub.subscribe(channel)

    async def enqueue(rid: str, max_tokens: int) -> None:
        request = GenerateRequest(request_id=rid, model="m", prompt_token_ids=[5, 6], reply_channel=channel,
                                  sampling=SamplingParams(max_tokens=max_tokens), deadline_unix_s=time.time() + 60)
        await client.xadd(keys.requests_stream("m"), {STREAM_FIELD: protocol.encode(request)})

    try:
        await enqueue("long", 8)
        async with running(worker):
            while backend.num_started < 3:
                await asyncio.sleep(0.005)
            await enqueue("late", 1)  # during step 3 (it sleeps 250 ms)
            assert backend.num_done == 2
            await asyncio.wait_for(replies_until_finished(pubsub, {"long", "late"}), 30)
    finally:
        await pubsub.aclose()
    assert backend.added_after == {"long": 0, "late": 3}


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_backend_admits_a_waiting_higher_class_first(vllm_backend) -> None:
    """vLLM's ``priority`` policy orders its waiting queue by class: with every sequence
    slot taken, an interactive request queued after a batch one gets the first free slot.
    (vLLM preempts nothing for it: it waits for that slot.)"""
    backend = vllm_backend
    for k in range(backend.max_num_seqs):  # run0 ends first, the others 4 steps later
        backend.add_request(f"run{k}", [1, 2, 3, 4 + k], SamplingParams(max_tokens=2 if k == 0 else 6,
                                                                        temperature=0.0, ignore_eos=True),
                            priority=BATCH)
    backend.step()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    backend.add_request("b", [1, 2, 3, 60], params, priority=BATCH)
    backend.add_request("i", [1, 2, 3, 70], params, priority=INTERACTIVE)
    first_step: dict[str, int] = {}
    for n in range(40):
        if not backend.has_unfinished_requests():
            break
        for out in backend.step():
            first_step.setdefault(out.request_id, n)
    assert not backend.has_unfinished_requests()
    assert first_step["i"] < first_step["b"]
