"""Fair share of a full engine's sequence slots between tenants (issue 15, item 2, engine
side; worker/engine/fair_share.py): a waiting request whose tenant runs at least two
fewer requests of its class than another tenant preempts (recompute) that tenant's most
recently admitted one, one per step; the worker pulls one such request from Redis while
the engine is full (``FairQueue.pull``'s ``extra``), and tells the engine each request's
tenant.

The scheduler is driven with hand-made tokens; the engine with a tiny Llama of dummy
weights shows the preempted requests still produce their greedy tokens; the pull and the
worker run on a real Redis.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import pytest

from shared import protocol
from shared.fair_queue import FairQueue
from shared.keys import STREAM_FIELD, Keys
from shared.model_source import ModelSource
from shared.protocol import GenerateRequest
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from worker.backends.sim import SimBackend
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request
from worker.engine.scheduler import Scheduler
from worker.service import Worker

pytestmark = pytest.mark.timeout(60)

DEFAULT = 1


def make(max_num_seqs: int) -> Scheduler:
    return Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs, 64)


def req(rid: str, tenant: str, priority: int = DEFAULT, max_tokens: int = 8) -> Request:
    base = 1000 * (sum(map(ord, rid)) % 40)
    return Request(rid, [base + j for j in range(1, 5)], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   priority=priority, tenant=tenant)


def step(s: Scheduler) -> tuple[set[str], list[str]]:
    """One step with made-up tokens: (ids scheduled, ids preempted)."""
    out = s.schedule()
    s.update(out, [7 if item.samples else None for item in out.scheduled])
    return {item.request.request_id for item in out.scheduled}, [r.request_id for r in out.preempted]


def running_per_tenant(s: Scheduler) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in s.running:
        counts[r.tenant] = counts.get(r.tenant, 0) + 1
    return counts


# -- the scheduler ---------------------------------------------------------------------------

def test_a_newcomer_tenant_takes_the_flooding_tenants_latest_slot() -> None:
    s = make(max_num_seqs=4)
    for i in range(6):
        s.add(req(f"a{i}", "A"))
    step(s)
    step(s)
    assert running_per_tenant(s) == {"A": 4} and s.num_admittable(DEFAULT) == 0
    assert s.fair_share_blocked(DEFAULT) == {"A"}  # A's next would wait; anyone else's would not
    s.add(req("b", "B"))
    scheduled, preempted = step(s)
    # B is admitted at once, in A's youngest's slot (a3); A's queued a4, a5 still wait.
    assert preempted == ["a3"] and "b" in scheduled and "a3" not in scheduled
    assert running_per_tenant(s) == {"A": 3, "B": 1}
    assert [r.request_id for r in s.waiting] == ["a3", "a4", "a5"]  # the victim resumes first
    # Max-min: B's second request takes another of A's slots, its third none (2 and 2).
    s.add(req("b2", "B"))
    assert step(s)[1] == ["a2"]
    s.add(req("b3", "B"))
    assert step(s)[1] == []
    assert running_per_tenant(s) == {"A": 2, "B": 2}
    assert s.fair_share_blocked(DEFAULT) == {"A", "B"}
    for _ in range(100):
        if not s.requests:
            break
        step(s)
    assert not s.requests and s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_a_waiting_request_of_the_large_tenant_does_not_block_another_tenants_claim() -> None:
    s = make(max_num_seqs=3)
    for i in range(4):  # a3 waits: A cannot take its own slots
        s.add(req(f"a{i}", "A"))
    step(s)
    s.add(req("b", "B"))
    scheduled, preempted = step(s)
    assert preempted == ["a2"] and "b" in scheduled


@pytest.mark.parametrize("tenants", [("A", "A"), ("", "")])
def test_one_tenant_is_first_come_first_served(tenants: tuple[str, str]) -> None:
    s = make(max_num_seqs=2)
    s.add(req("x1", tenants[0]))
    s.add(req("x2", tenants[0]))
    step(s)
    s.add(req("y", tenants[1]))
    assert step(s) == ({"x1", "x2"}, [])
    assert s.fair_share_blocked(DEFAULT) == {tenants[0]}


def test_one_claim_per_step_and_none_below_the_gap() -> None:
    s = make(max_num_seqs=2)
    s.add(req("a1", "A", priority=2))
    s.add(req("a2", "A", priority=2))
    step(s)
    s.add(req("b", "B", priority=2))
    s.add(req("c", "C", priority=2))
    assert step(s)[1] == ["a2"]  # one claim per step: c waits
    assert step(s)[1] == []  # A and B run one each: no tenant holds two more than C
    assert s.fair_share_blocked(2) is None


# -- the engine: preempted requests still produce their greedy tokens ---------------------------

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "eos_token_id": 0}
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_engine_outputs_are_unchanged_by_a_fair_share_preemption() -> None:
    from worker.engine.engine import LLMEngine

    engine = LLMEngine(ModelSource("tiny", None, dict(TINY), dummy=True),
                       ModelSettings(device="cpu", dtype="float32", max_model_len=256),
                       EngineSettings(num_kv_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=64,
                                      attention_backend="torch"))
    rng = random.Random(1)
    prompts = {rid: [rng.randrange(1, 256) for _ in range(6)] for rid in ("a0", "a1", "a2", "b")}

    def run(with_b: bool) -> tuple[dict[str, list[int]], int]:
        outs: dict[str, list[int]] = {rid: [] for rid in ("a0", "a1", "a2")}
        for rid in outs:
            engine.add_request(rid, prompts[rid], GREEDY, tenant="A")
        b_first_step = -1
        for n in range(100):
            if with_b and n == 3:
                engine.add_request("b", prompts["b"], GREEDY, tenant="B")
                outs["b"] = []
            if not engine.has_unfinished_requests():
                return outs, b_first_step
            for out in engine.step():
                assert out.first_index == len(outs[out.request_id])
                outs[out.request_id] += out.new_token_ids
                if out.request_id == "b" and b_first_step < 0:
                    b_first_step = n
        raise AssertionError("not finished")

    expected, _ = run(with_b=False)
    expected_b = {}
    engine.add_request("b", prompts["b"], GREEDY, tenant="B")
    while engine.has_unfinished_requests():
        for out in engine.step():
            expected_b.setdefault(out.request_id, []).extend(out.new_token_ids)
    before = engine.stats().num_preemptions
    got, b_first_step = run(with_b=True)
    assert b_first_step == 3  # in the step it arrived before, though A held every slot
    assert engine.stats().num_preemptions == before + 1
    assert got == {**expected, **expected_b}
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, 32)


# -- the pull and the worker (real Redis) ------------------------------------------------------

def _request(rid: str, channel: str = "tfs:gateway:g") -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", prompt_token_ids=[5, 6, 7],
                           sampling=SamplingParams(max_tokens=4), reply_channel=channel,
                           deadline_unix_s=time.time() + 60, priority=DEFAULT)


def _ids(pulled: list[tuple[str, bytes, dict[bytes, bytes]]]) -> list[str]:
    return [protocol.decode(fields[STREAM_FIELD]).request_id for _, _, fields in pulled]


async def test_a_full_engine_pulls_one_request_of_a_tenant_not_excluded(client) -> None:
    queue = FairQueue(client, Keys(f"tfs{uuid.uuid4().hex[:8]}"), "m")
    for i in range(3):
        await queue.enqueue(queue.stream("default", "A"), [_request(f"a{i}")])
    for rid in ("b0", "b1"):
        await queue.enqueue(queue.stream("default", "B"), [_request(rid)])
    await queue.enqueue(queue.stream("default", "C"), [_request("c0")])
    full = [0, 0, 0]
    assert await queue.pull("w", full) == []
    # A and C excluded (as a worker full of A's and with C's waiting would): one of B's.
    excluded = [queue.stream("default", "A"), queue.stream("default", "C")]
    assert _ids(await queue.pull("w", full, [0, 1, 0], excluded)) == ["b0"]
    assert _ids(await queue.pull("w", full, [0, 1, 0], [queue.stream("default", "A")])) == ["c0"]
    assert await queue.pull("w", full, [0, 0, 0], []) == []  # no extra: nothing
    assert await queue.pull("w", full, [0, 1, 0], [queue.stream("default", t) for t in "ABC"]) == []


class TenantSim(SimBackend):
    """A sim that is full and reports tenant A as the one whose requests find no slot."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tenants: dict[str, str] = {}

    def add_request(self, request_id: str, *args: Any, tenant: str = "", **kwargs: Any) -> None:
        super().add_request(request_id, *args, **kwargs)
        self.tenants[request_id] = tenant

    def num_admittable(self, priority: int | None = None) -> int:
        return 0

    def fair_share_blocked(self, priority: int) -> set[str] | None:
        return {"A"} if priority == DEFAULT else None


async def test_a_full_worker_pulls_another_tenants_request_and_names_its_tenant(client) -> None:
    keys = Keys(f"tfs{uuid.uuid4().hex[:8]}")
    backend = TenantSim(ModelSettings(max_model_len=1000), EngineSettings(max_num_seqs=2), step_time_ms=1.0)
    worker = Worker(client, keys, "m", "w1", backend)
    await worker._ensure_group()
    for i in range(2):
        await worker.queue.enqueue(worker.queue.stream("default", "A"), [_request(f"a{i}")])
    await worker.queue.enqueue(worker.queue.stream("default", "B"), [_request("b")])
    await worker._pull(block_ms=None)
    assert backend.tenants == {"b": "B"}
    await worker._pull(block_ms=None)  # B has nothing more; A's are excluded
    assert backend.tenants == {"b": "B"}
